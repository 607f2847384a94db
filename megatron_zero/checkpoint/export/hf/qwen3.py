"""Qwen3ForCausalLM <-> our GPT: Llama's mapping (llama.py) plus QK-norm and a head dimension of its own.

Qwen3 is Llama with an RMSNorm over each head's query and key before RoPE (`self_attn.q_norm`, `k_norm`
[head_dim]: our --qk-layernorm's `q_layernorm` / `k_layernorm`), `head_dim` independent of hidden_size /
heads (our --kv-channels), and biases on neither the attention (attention_bias, false in every released
model; true is taken) nor the MLP. Sliding-window attention (`use_sliding_window`, off in the released
models) is refused: our attention is full causal attention.
"""
from __future__ import annotations

from typing import List

from ....model.config import GPTConfig
from ....model.layer_indices import block_layer_index
from ...errors import CheckpointError
from . import llama
from .mapping import TensorMapping, same

HF_ARCHITECTURE = "Qwen3ForCausalLM"
MODEL_TYPE = "qwen3"
SKIPPED_HF = llama.SKIPPED_HF
PRESERVED_HF = ("max_window_layers",)


def config_from_hf(hf: dict, what: str = "Qwen3") -> GPTConfig:
    if hf.get("use_sliding_window"):
        raise CheckpointError(f"this {what} config has use_sliding_window true, which our GPT does not implement "
                              "(full causal attention only)")
    config = llama.config_from_hf({**hf, "mlp_bias": hf.get("attention_bias", False)}, what)
    config.qk_layernorm = True
    return config


def matches(config: GPTConfig) -> bool:
    return llama.matches(config, qk_layernorm=True)


def flags(config: GPTConfig) -> List[str]:
    return llama.flags(config) + ["--qk-layernorm"]


def hf_config(config: GPTConfig) -> dict:
    out = {k: v for k, v in llama.hf_config(config).items() if k != "mlp_bias"}
    return {**out, "architectures": [HF_ARCHITECTURE], "model_type": MODEL_TYPE, "use_sliding_window": False,
            "sliding_window": None}


def qk_norm_mappings(ours: str, hf: str) -> List[TensorMapping]:
    """A block's QK-norm weights: ours `{ours}self_attention.{q,k}_layernorm.weight`, HF `{hf}self_attn.{q,k}_norm`."""
    return [same(f"{ours}self_attention.{p}_layernorm.weight", f"{hf}self_attn.{p}_norm.weight") for p in "qk"]


def with_qk_norms(config: GPTConfig, mappings: List[TensorMapping]) -> List[TensorMapping]:
    """`mappings` (Llama's order) with each block's QK-norm weights after its attention's output projection."""
    out = []
    for m in mappings:
        out.append(m)
        for b in range(config.num_layers):
            i = f"{block_layer_index(b)}."
            if m.ours == i + ("self_attention.dense.bias" if config.add_bias_linear else "self_attention.dense.weight"):
                out += qk_norm_mappings(i, f"model.layers.{b}.")
    return out


def tensor_mappings(config: GPTConfig, block_mlp=llama.dense_block_mlp) -> List[TensorMapping]:
    return with_qk_norms(config, llama.tensor_mappings(config, block_mlp))
