"""Megatron-Core's parameter names (GPTModel, local or Transformer-Engine layer spec) for ours.

    mcore_key(name, config) -> (key, layer)   # layer: the block's index in the stacked tensor, or None

Megatron-Core's torch_dist checkpoints stack the transformer layers on dim 0
(`decoder.layers.<suffix>` is [num_layers, ...]); the norms before attention and MLP are saved
under the linear layer they feed, whichever spec built the model (the Transformer-Engine names):

    ours                                    Megatron-Core (decoder.layers.*)
    {i}.input_layernorm.weight|bias          self_attention.linear_qkv.layer_norm_weight|bias
    {i}.self_attention.query_key_value.*     self_attention.linear_qkv.*    (per query group [q; k; v]: the same)
    {i}.self_attention.dense.*               self_attention.linear_proj.*
    {i}.post_attention_layernorm.weight|bias mlp.linear_fc1.layer_norm_weight|bias
    {i}.mlp.dense_h_to_4h.*                  mlp.linear_fc1.*               (SwiGLU [gate; up]: the same)
    {i}.mlp.dense_4h_to_h.*                  mlp.linear_fc2.*
    {L+2}.weight|bias                        decoder.final_layernorm.weight|bias
    word / position embeddings               embedding.word_embeddings.weight, embedding.position_embeddings.weight
    {L+3}.lm_head.weight (untied)            output_layer.weight
    {L+4}.{k}.enorm|hnorm|eh_proj|final_layernorm.*   mtp.layers.{k}.<the same>   (multi-token prediction)
    {L+4}.{k}.transformer_layer.<a block's>  mtp.layers.{k}.transformer_layer.<its name above> (not stacked)

An MoE block (mcore_location; Megatron-Core's SequentialMLP, GroupedMLP and TEGroupedMLP all save these):
    {i}.mlp.deepspeed_moe.gate.wg.weight      mlp.router.weight                        [L, E, h]
    {i}.mlp.deepspeed_moe.experts.deepspeed_experts.{e}.dense_h_to_4h.*
                                             mlp.experts.experts.linear_fc1.*          [L, E, ...]
    ... .{e}.dense_4h_to_h.*                  mlp.experts.experts.linear_fc2.*          [L, E, ...]
    {i}.mlp.shared_expert.dense_h_to_4h|dense_4h_to_h.*
                                             mlp.shared_experts.linear_fc1|linear_fc2.*
    {i}.mlp.shared_expert_gate.weight         mlp.shared_experts.gate_weight            [L, 1, h]
    {i}.mlp.deepspeed_moe.gate.expert_bias    mlp.router.expert_bias                   [L, E]  (a buffer: expert_bias_names)
    {i}.post_attention_layernorm.*           mlp.linear_fc1.layer_norm_* (local spec), or pre_mlp_layernorm.*

Both fused layouts agree with ours, so tensors map one to one. The stacked form is `mcore_location`'s;
torch_dist.py also finds the per-layer and per-expert forms Megatron-Core writes otherwise. Keys no
parameter or buffer maps to (the router's expert bias without --moe-router-enable-expert-bias, q/k layernorm)
are refused by `unmapped`, naming the key.
"""
from __future__ import annotations

from typing import Iterable, List, Optional, Tuple

from ...model.config import GPTConfig
from ...model.layer_indices import block_layer_index, block_number, final_norm_index, is_block_index, mtp_index
from ...model.params import (MTP_LAYER_PREFIX, lm_head_name, param_names, parse_expert_suffix, parse_mtp_suffix,
                             position_embeddings_name, word_embeddings_name)

BLOCK = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "input_layernorm.bias": "self_attention.linear_qkv.layer_norm_bias",
    "self_attention.query_key_value.weight": "self_attention.linear_qkv.weight",
    "self_attention.query_key_value.bias": "self_attention.linear_qkv.bias",
    "self_attention.dense.weight": "self_attention.linear_proj.weight",
    "self_attention.dense.bias": "self_attention.linear_proj.bias",
    "post_attention_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
    "post_attention_layernorm.bias": "mlp.linear_fc1.layer_norm_bias",
    "mlp.dense_h_to_4h.weight": "mlp.linear_fc1.weight",
    "mlp.dense_h_to_4h.bias": "mlp.linear_fc1.bias",
    "mlp.dense_4h_to_h.weight": "mlp.linear_fc2.weight",
    "mlp.dense_4h_to_h.bias": "mlp.linear_fc2.bias",
}
MOE_BLOCK = {
    "mlp.deepspeed_moe.gate.wg.weight": "mlp.router.weight",
    "mlp.shared_expert.dense_h_to_4h.weight": "mlp.shared_experts.linear_fc1.weight",
    "mlp.shared_expert.dense_h_to_4h.bias": "mlp.shared_experts.linear_fc1.bias",
    "mlp.shared_expert.dense_4h_to_h.weight": "mlp.shared_experts.linear_fc2.weight",
    "mlp.shared_expert.dense_4h_to_h.bias": "mlp.shared_experts.linear_fc2.bias",
    "mlp.shared_expert_gate.weight": "mlp.shared_experts.gate_weight",
    "mlp.deepspeed_moe.gate.expert_bias": "mlp.router.expert_bias",
}
EXPERT_MLP = {"mlp.dense_h_to_4h.weight": "linear_fc1.weight", "mlp.dense_h_to_4h.bias": "linear_fc1.bias",
              "mlp.dense_4h_to_h.weight": "linear_fc2.weight", "mlp.dense_4h_to_h.bias": "linear_fc2.bias"}
EXPERTS = "mlp.experts.experts."
LAYERS = "decoder.layers."
OPTIMIZER_PREFIX = "optimizer.state."
EXPERT_MARKERS = (".mlp.experts.", ".mlp.router.", ".mlp.shared_experts.")


def mcore_key(name: str, config: GPTConfig) -> Tuple[str, Optional[int]]:
    """Megatron-Core's key for our parameter `name` and, for a block's, its layer in the stack (dense
    parameters: an expert's key stacks experts too, see mcore_location)."""
    key, index = mcore_location(name, config)
    if len(index) > 1:
        raise ValueError(f"{name!r} is an expert's parameter: its Megatron-Core tensor stacks layers and experts")
    return key, (index[0] if index else None)


def mcore_location(name: str, config: GPTConfig) -> Tuple[str, Tuple[int, ...]]:
    """Megatron-Core's stacked key for our parameter `name` and its index there: () for a tensor of its own,
    (layer,) for a block's, (layer, expert) for an expert's."""
    index, _, suffix = name.partition(".")
    if index.isdigit() and is_block_index(int(index), config.num_layers):
        layer = block_number(int(index))
        parsed = parse_expert_suffix(suffix)
        if parsed is not None and parsed[1] in EXPERT_MLP:
            return LAYERS + EXPERTS + EXPERT_MLP[parsed[1]], (layer, parsed[0])
        if suffix in MOE_BLOCK:
            return LAYERS + MOE_BLOCK[suffix], (layer,)
    key, layer = _dense_key(name, config)
    return key, (() if layer is None else (layer,))


def _dense_key(name: str, config: GPTConfig) -> Tuple[str, Optional[int]]:
    if name == word_embeddings_name(config):
        return "embedding.word_embeddings.weight", None
    if name == position_embeddings_name(config):
        return "embedding.position_embeddings.weight", None
    if name == lm_head_name(config):
        return "output_layer.weight", None
    index, _, suffix = name.partition(".")
    if index.isdigit() and is_block_index(int(index), config.num_layers) and suffix in BLOCK:
        return LAYERS + BLOCK[suffix], block_number(int(index))
    if index.isdigit() and int(index) == final_norm_index(config.num_layers):
        return f"decoder.final_layernorm.{suffix}", None
    depth = parse_mtp_suffix(suffix) if index.isdigit() and int(index) == mtp_index(config.num_layers) else None
    if depth is not None:  # a multi-token prediction depth: its own tensors, not stacked
        k, local = depth
        if local.startswith(MTP_LAYER_PREFIX) and local[len(MTP_LAYER_PREFIX):] in BLOCK:
            return f"mtp.layers.{k}.transformer_layer.{BLOCK[local[len(MTP_LAYER_PREFIX):]]}", None
        if local.startswith(MTP_LAYER_PREFIX + "mlp."):
            raise ValueError(f"{name!r} belongs to an MoE multi-token prediction layer, which has no Megatron-Core "
                             "name here")
        return f"mtp.layers.{k}.{local}", None
    raise ValueError(f"{name!r} has no Megatron-Core name")


def refuse_moe_mtp(config: GPTConfig, where: str) -> None:
    """One sentence for a model with MoE multi-token prediction layers, whose Megatron-Core names are not mapped."""
    if config.mtp_num_layers and config.is_moe_layer(config.num_layers - 1):
        from ..errors import CheckpointError
        raise CheckpointError(f"{where} is a model with MoE multi-token prediction layers (--mtp-num-layers with an "
                              "MoE last layer), whose Megatron-Core torch_dist names are not mapped here; convert it "
                              "to universal or dcp instead")


def expert_bias_names(config: GPTConfig) -> List[str]:
    """Our names of the model's expert biases (buffers, not parameters: moe/expert_bias.py), one per MoE block."""
    if not config.num_experts or not config.moe_router_enable_expert_bias:
        return []
    return [f"{block_layer_index(b)}.mlp.deepspeed_moe.gate.expert_bias" for b in range(config.num_layers)
            if config.is_moe_layer(b)]


def mcore_keys(config: GPTConfig) -> List[str]:
    """Every Megatron-Core tensor key this model's parameters map to, in first-use order."""
    seen = []
    for name in param_names(config):
        key, _ = mcore_location(name, config)
        if key not in seen:
            seen.append(key)
    return seen


def unmapped(keys: Iterable[str], config: GPTConfig, known: Optional[Iterable[str]] = None) -> List[str]:
    """The model keys among `keys` that no parameter of ours maps to (optimizer state, `_extra_state`
    and the output layer of a tied model, which Megatron-Core saves as the embedding's replica, aside);
    `known`: the keys our parameters were found under (default: the stacked forms, mcore_keys)."""
    known = set(mcore_keys(config) if known is None else known)
    out = []
    for key in keys:
        if key.startswith(OPTIMIZER_PREFIX) or "_extra_state" in key or key in known:
            continue
        if key == "output_layer.weight" and not config.untie_embeddings_and_output_weights:
            continue
        out.append(key)
    return out


def refusal(key: str, where: str) -> str:
    """One sentence for a key that cannot be mapped."""
    if any(m in "." + key for m in EXPERT_MARKERS):
        return (f"{where} holds the mixture-of-experts tensor {key}, which no parameter of this model maps to "
                "(the router's expert bias: give --moe-router-enable-expert-bias; otherwise the checkpoint's args "
                "describe another model: --num-experts, --moe-layer-freq, the shared expert)")
    return (f"{where} holds {key}, which no parameter of this model maps to (a layer type or architecture "
            "this trainer does not build, or flags that describe another model)")
