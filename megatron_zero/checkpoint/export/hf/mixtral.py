"""MixtralForCausalLM <-> our Llama-style GPT with an MoE layer in every block (moe_mapping.py).

Attention, norms, embeddings and the sliding window are Mistral's (mistral.py). Every block's MLP is an MoE
layer of `num_local_experts` SwiGLU experts of width `intermediate_size` (--moe-ffn-hidden-size), routed
to `num_experts_per_tok` (--moe-router-topk) by softmax, top-k, renormalised: our default router.
Tensors: `model.layers.{b}.block_sparse_moe.gate.weight` (the router) and
`block_sparse_moe.experts.{e}.w1` (gate), `w3` (up), `w2` (down). Refused: router jitter noise (ours has none).
"""
from __future__ import annotations

import dataclasses
from typing import List

from ....model.config import GPTConfig
from ...errors import CheckpointError
from . import llama, mistral
from .moe_mapping import dropless_topk, moe_block_mappings, moe_flags

HF_ARCHITECTURE = "MixtralForCausalLM"
MODEL_TYPE = "mixtral"
SKIPPED_HF = llama.SKIPPED_HF
PRESERVED_HF = ("sliding_window", "router_aux_loss_coef")


def config_from_hf(hf: dict) -> GPTConfig:
    if float(hf.get("router_jitter_noise") or 0.0) != 0.0:
        raise CheckpointError(f"this Mixtral config has router_jitter_noise {hf['router_jitter_noise']}, which our "
                              "router does not implement (set it to 0)")
    config = mistral.config_from_hf(hf)
    return dataclasses.replace(config, num_experts=int(hf.get("num_local_experts", 8)),
                               moe_router_topk=int(hf.get("num_experts_per_tok", 2)),
                               moe_ffn_hidden_size=hf["intermediate_size"])


def flags(config: GPTConfig) -> List[str]:
    return llama.flags(config) + moe_flags(config)


def matches(config: GPTConfig) -> bool:
    return (dropless_topk(config) and config.moe_layer_freq == 1 and not config.moe_router_pre_softmax
            and not config.moe_shared_expert_intermediate_size and not config.add_qkv_bias
            and config.normalization == "RMSNorm" and config.position_embedding_type == "rope" and config.swiglu
            and config.rotary_percent == 1.0 and not config.qk_layernorm)


def hf_config(config: GPTConfig) -> dict:
    out = {**mistral.hf_config(config), "architectures": [HF_ARCHITECTURE], "model_type": MODEL_TYPE}
    return {**out, "intermediate_size": config.moe_ffn_hidden_size, "num_local_experts": config.num_experts,
            "num_experts_per_tok": config.moe_router_topk, "router_jitter_noise": 0.0, "output_router_logits": False}


def _block_mlp(config: GPTConfig, block: int, ours: str, hf: str):
    return moe_block_mappings(config, ours, hf, "block_sparse_moe.gate.weight", "block_sparse_moe.experts.{}.",
                              ("w1", "w3", "w2"))


def tensor_mappings(config: GPTConfig):
    return llama.tensor_mappings(config, _block_mlp)
