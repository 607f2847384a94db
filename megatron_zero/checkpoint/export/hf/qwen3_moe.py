"""Qwen3MoeForCausalLM <-> our GPT with Qwen3's attention (qwen3.py: QK-norm, its own head dimension) and an MoE
layer in every block, no shared expert (moe_mapping.py).

    Hugging Face (block b)                          ours
    self_attn.{q,k}_norm.weight [head_dim]          self_attention.{q,k}_layernorm.weight (--qk-layernorm)
    mlp.gate.weight                                 mlp.deepspeed_moe.gate.wg.weight
    mlp.experts.{e}.{gate,up,down}_proj.weight      the expert's dense_h_to_4h [gate; up], dense_4h_to_h

The expert count is `num_experts` (the released config.json files) or `num_local_experts` (transformers 5.x).
Router: softmax over all experts, top-k, renormalised where norm_topk_prob (every released Qwen3-MoE: our
default router), else not (--moe-router-pre-softmax). Placement: decoder_sparse_step 1 with no mlp_only_layers
(every released model) is what an import takes; sliding-window attention is refused.
"""
from __future__ import annotations

import dataclasses
from typing import List

from ....model.config import GPTConfig
from ...errors import CheckpointError
from . import llama, qwen3
from .moe_mapping import dropless_topk, moe_block_mappings, moe_flags

HF_ARCHITECTURE = "Qwen3MoeForCausalLM"
MODEL_TYPE = "qwen3_moe"
SKIPPED_HF = llama.SKIPPED_HF
PRESERVED_HF = ("router_aux_loss_coef", "max_window_layers", "sliding_window")


def config_from_hf(hf: dict) -> GPTConfig:
    step, dense = int(hf.get("decoder_sparse_step", 1)), list(hf.get("mlp_only_layers") or [])
    if step != 1 or dense:
        raise CheckpointError(f"this Qwen3-MoE config has decoder_sparse_step {step} and mlp_only_layers {dense}, MoE "
                              "layers in blocks that --moe-layer-freq cannot place (decoder_sparse_step 1, "
                              "mlp_only_layers [] can)")
    config = qwen3.config_from_hf(hf, "Qwen3-MoE")
    return dataclasses.replace(config, num_experts=int(hf.get("num_experts") or hf.get("num_local_experts") or 128),
                               moe_router_topk=int(hf.get("num_experts_per_tok", 8)),
                               moe_ffn_hidden_size=int(hf["moe_intermediate_size"]),
                               moe_router_pre_softmax=not hf.get("norm_topk_prob", False))


def flags(config: GPTConfig) -> List[str]:
    return qwen3.flags(config) + moe_flags(config)


def matches(config: GPTConfig) -> bool:
    return (dropless_topk(config) and config.moe_layer_freq == 1 and not config.moe_shared_expert_intermediate_size
            and not config.add_qkv_bias and config.qk_layernorm and config.normalization == "RMSNorm"
            and config.position_embedding_type == "rope" and config.swiglu and config.rotary_percent == 1.0)


def hf_config(config: GPTConfig) -> dict:
    out = {**qwen3.hf_config(config), "architectures": [HF_ARCHITECTURE], "model_type": MODEL_TYPE}
    return {**out, "num_experts": config.num_experts, "num_experts_per_tok": config.moe_router_topk,
            "moe_intermediate_size": config.moe_ffn_hidden_size, "norm_topk_prob": not config.moe_router_pre_softmax,
            "decoder_sparse_step": 1, "mlp_only_layers": [], "output_router_logits": False}


def _block_mlp(config: GPTConfig, block: int, ours: str, hf: str):
    return moe_block_mappings(config, ours, hf, "mlp.gate.weight", "mlp.experts.{}.",
                              ("gate_proj", "up_proj", "down_proj"))


def tensor_mappings(config: GPTConfig):
    return qwen3.tensor_mappings(config, _block_mlp)
