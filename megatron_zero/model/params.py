"""The parameter catalogue: every parameter's name, full (unsharded) shape, TP split and init.

Names are Megatron-DeepSpeed's pipeline names. The full shape of the word
embedding is the *unpadded* one, [config.vocab_size, h]; padding to
`config.padded_vocab_size(tp)` happens when a full tensor is sharded.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple

from .config import GPTConfig
from .layers import (EMBEDDING_INDEX, final_norm_index, is_block_index, lm_head_index, num_pipeline_layers)

WORD_EMBEDDINGS = "tied_modules.embed.word_embeddings.weight"
POSITION_EMBEDDINGS = "tied_modules.embed.position_embeddings.weight"

# suffix within a block -> (partition_dim or None, init kind)
BLOCK_PARAMS = {
    "input_layernorm.weight": (None, "ones"),
    "input_layernorm.bias": (None, "zeros"),
    "self_attention.query_key_value.weight": (0, "normal"),
    "self_attention.query_key_value.bias": (0, "zeros"),
    "self_attention.dense.weight": (1, "scaled_normal"),
    "self_attention.dense.bias": (None, "zeros"),
    "post_attention_layernorm.weight": (None, "ones"),
    "post_attention_layernorm.bias": (None, "zeros"),
    "mlp.dense_h_to_4h.weight": (0, "normal"),
    "mlp.dense_h_to_4h.bias": (0, "zeros"),
    "mlp.dense_4h_to_h.weight": (1, "scaled_normal"),
    "mlp.dense_4h_to_h.bias": (None, "zeros"),
}


@dataclass(frozen=True)
class ParamSpec:
    name: str
    full_shape: Tuple[int, ...]
    partition_dim: Optional[int]  # None: replicated across TP
    init: str                     # 'normal', 'scaled_normal', 'zeros' or 'ones'
    is_vocab: bool = False        # rows are the (padded) vocabulary


def _block_shape(suffix: str, c: GPTConfig) -> Tuple[int, ...]:
    h, f = c.hidden_size, c.ffn_hidden_size
    return {
        "self_attention.query_key_value.weight": (3 * h, h),
        "self_attention.query_key_value.bias": (3 * h,),
        "self_attention.dense.weight": (h, h),
        "mlp.dense_h_to_4h.weight": (f, h),
        "mlp.dense_h_to_4h.bias": (f,),
        "mlp.dense_4h_to_h.weight": (h, f),
    }.get(suffix, (h,))


def param_spec(name: str, config: GPTConfig) -> ParamSpec:
    """What a parameter is, from its name alone; raises ValueError on a name this model has not."""
    h = config.hidden_size
    if name == WORD_EMBEDDINGS:
        return ParamSpec(name, (config.vocab_size, h), 0, "normal", is_vocab=True)
    if name == POSITION_EMBEDDINGS:
        return ParamSpec(name, (config.max_position_embeddings, h), None, "normal")
    index, _, suffix = name.partition(".")
    if index.isdigit():
        i = int(index)
        if is_block_index(i, config.num_layers) and suffix in BLOCK_PARAMS:
            dim, init = BLOCK_PARAMS[suffix]
            return ParamSpec(name, _block_shape(suffix, config), dim, init)
        if i == final_norm_index(config.num_layers) and suffix in ("weight", "bias"):
            return ParamSpec(name, (h,), None, "ones" if suffix == "weight" else "zeros")
    raise ValueError(f"{name!r} is not a parameter of a GPT with {config.num_layers} layers")


def layer_param_names(layer_index: int, config: GPTConfig) -> List[str]:
    L = config.num_layers
    if layer_index == EMBEDDING_INDEX:
        return [WORD_EMBEDDINGS, POSITION_EMBEDDINGS]
    if is_block_index(layer_index, L):
        return [f"{layer_index}.{suffix}" for suffix in BLOCK_PARAMS]
    if layer_index == final_norm_index(L):
        return [f"{layer_index}.weight", f"{layer_index}.bias"]
    return []


def param_names(config: GPTConfig, layer_indices=None) -> List[str]:
    """Every parameter name of the layers given (default: the whole model), in module order."""
    indices = list(range(num_pipeline_layers(config.num_layers)) if layer_indices is None else layer_indices)
    names = []
    if lm_head_index(config.num_layers) in indices and EMBEDDING_INDEX not in indices:
        names += layer_param_names(EMBEDDING_INDEX, config)
    for i in indices:
        names += layer_param_names(i, config)
    return names
