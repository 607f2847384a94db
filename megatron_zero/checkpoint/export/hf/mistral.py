"""MistralForCausalLM <-> our GPT: Llama's mapping (llama.py) under Mistral's names, plus the sliding window.

Mistral's tensors and config keys are Llama's, without biases. Its `sliding_window` limits attention to the last
W tokens; our attention is full causal attention, which is the same computation for sequences of
at most W tokens, so an import sets --seq-length to min(max_position_embeddings, W) and the
window is carried into an export's config.json unchanged.
"""
from __future__ import annotations


from ....model.config import GPTConfig
from . import llama

HF_ARCHITECTURE = "MistralForCausalLM"
MODEL_TYPE = "mistral"
SKIPPED_HF = llama.SKIPPED_HF
PRESERVED_HF = ("sliding_window",)
tensor_mappings = llama.tensor_mappings
flags = llama.flags


def matches(config: GPTConfig) -> bool:
    return llama.matches(config) and not config.add_bias_linear  # Mistral has no biases


def config_from_hf(hf: dict) -> GPTConfig:
    config = llama.config_from_hf(hf, "Mistral")
    if hf.get("sliding_window"):
        config.seq_length = min(config.seq_length, int(hf["sliding_window"]))
    return config


def hf_config(config: GPTConfig) -> dict:
    out = {k: v for k, v in llama.hf_config(config).items() if k not in ("attention_bias", "mlp_bias")}
    return {**out, "architectures": [HF_ARCHITECTURE], "model_type": MODEL_TYPE, "sliding_window": None}
