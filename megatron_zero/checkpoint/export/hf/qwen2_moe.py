"""Qwen2MoeForCausalLM <-> our Llama-style GPT with QKV biases (--add-qkv-bias), MoE layers and a gated shared
expert (moe_mapping.py, moe/shared_expert.py).

    Hugging Face (block b)                          ours
    self_attn.{q,k,v}_proj.bias (qkv_bias)          self_attention.query_key_value.bias (--add-qkv-bias)
    mlp.gate.weight                                 mlp.deepspeed_moe.gate.wg.weight
    mlp.experts.{e}.{gate,up,down}_proj.weight      the expert's dense_h_to_4h [gate; up], dense_4h_to_h
    mlp.shared_expert.{gate,up,down}_proj.weight    mlp.shared_expert.* (--moe-shared-expert-intermediate-size)
    mlp.shared_expert_gate.weight [1, h]            mlp.shared_expert_gate.weight (--moe-shared-expert-gate)
    a dense block's mlp.{gate,up,down}_proj         mlp.* (width intermediate_size: --ffn-hidden-size)

Router: softmax over all experts, top-k, renormalised where norm_topk_prob (our default router), else not
(--moe-router-pre-softmax). Placement: block i is sparse where (i + 1) % decoder_sparse_step == 0 and i is
not in mlp_only_layers; we place MoE layers in blocks 0, N, 2N, ... (--moe-layer-freq N), so
decoder_sparse_step 1 with no mlp_only_layers is what an import takes; sliding-window attention is refused.
"""
from __future__ import annotations

import dataclasses
from typing import List

from ....model.config import GPTConfig
from ....model.params import SHARED_EXPERT_GATE_SUFFIX
from ...errors import CheckpointError
from . import llama
from .mapping import same
from .moe_mapping import dropless_topk, moe_block_mappings, moe_flags

HF_ARCHITECTURE = "Qwen2MoeForCausalLM"
MODEL_TYPE = "qwen2_moe"
SKIPPED_HF = llama.SKIPPED_HF
PRESERVED_HF = ("router_aux_loss_coef", "max_window_layers", "sliding_window")


def config_from_hf(hf: dict) -> GPTConfig:
    def refuse(feature):
        raise CheckpointError(f"this Qwen2-MoE config has {feature}, which our GPT does not implement")

    if hf.get("use_sliding_window"):
        refuse("use_sliding_window true (sliding-window attention)")
    step, dense = int(hf.get("decoder_sparse_step", 1)), list(hf.get("mlp_only_layers") or [])
    if step != 1 or dense:
        refuse(f"decoder_sparse_step {step} and mlp_only_layers {dense}, MoE layers in blocks that "
               "--moe-layer-freq (blocks 0, N, 2N, ...) cannot place (decoder_sparse_step 1, mlp_only_layers [] can)")
    shared = int(hf.get("shared_expert_intermediate_size") or 0)
    if shared < 1:
        refuse(f"shared_expert_intermediate_size {shared} (a shared expert of no width)")
    base = {**hf, "attention_bias": False}
    config = llama.config_from_hf(base, "Qwen2-MoE")
    return dataclasses.replace(config, add_qkv_bias=bool(hf.get("qkv_bias", True)),
                               num_experts=int(hf.get("num_experts", 60)),
                               moe_router_topk=int(hf.get("num_experts_per_tok", 4)),
                               moe_ffn_hidden_size=int(hf["moe_intermediate_size"]),
                               moe_router_pre_softmax=not hf.get("norm_topk_prob", False),
                               moe_shared_expert_intermediate_size=shared, moe_shared_expert_gate=True)


def flags(config: GPTConfig) -> List[str]:
    return llama.flags(config) + (["--add-qkv-bias"] if config.add_qkv_bias else []) + moe_flags(config)


def matches(config: GPTConfig) -> bool:
    return (dropless_topk(config) and config.moe_layer_freq == 1 and config.moe_shared_expert_gate
            and config.normalization == "RMSNorm" and config.position_embedding_type == "rope" and config.swiglu
            and config.rotary_percent == 1.0 and not config.qk_layernorm)


def hf_config(config: GPTConfig) -> dict:
    out = {k: v for k, v in llama.hf_config(config).items() if k not in ("attention_bias", "mlp_bias")}
    return {**out, "architectures": [HF_ARCHITECTURE], "model_type": MODEL_TYPE, "qkv_bias": config.add_qkv_bias,
            "num_experts": config.num_experts, "num_experts_per_tok": config.moe_router_topk,
            "moe_intermediate_size": config.moe_ffn_hidden_size,
            "shared_expert_intermediate_size": config.moe_shared_expert_intermediate_size,
            "norm_topk_prob": not config.moe_router_pre_softmax, "decoder_sparse_step": 1, "mlp_only_layers": [],
            "use_sliding_window": False, "output_router_logits": False}


def _block_mlp(config: GPTConfig, block: int, ours: str, hf: str):
    out = moe_block_mappings(config, ours, hf, "mlp.gate.weight", "mlp.experts.{}.",
                             ("gate_proj", "up_proj", "down_proj"))
    out += llama.mlp_mappings(ours + "mlp.shared_expert.", hf + "mlp.shared_expert.", ("weight",))
    return out + [same(ours + SHARED_EXPERT_GATE_SUFFIX, hf + "mlp.shared_expert_gate.weight")]


def tensor_mappings(config: GPTConfig):
    return llama.tensor_mappings(config, _block_mlp)
