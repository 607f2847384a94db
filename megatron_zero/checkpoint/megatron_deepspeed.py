"""Megatron-DeepSpeed's own checkpoint layouts, and their names and client state in ours.

Megatron-DeepSpeed (MDS) writes DeepSpeed's layout in two forms:
  pipeline engine (its default)   weights in layer_{i:02d}-model_{tp:02d}-model_states.pt under our names
                                  (ours follow its GPTModelPipe); `module` in mp_rank_* is None
  --no-pipeline-parallel          weights nested in mp_rank_{tp:02d}_model_states.pt's `module`:
                                  language_model -> embedding -> word_embeddings / position_embeddings,
                                  language_model -> encoder -> layers.{k}.<suffix>, final_layernorm.*
                                  (language_model -> output_layer -> weight when untied); the optimizer's
                                  names (param_shapes, param_slice_mappings) are the dotted paths
                                  `language_model.embedding.word_embeddings.weight`, ...
and with ZeRO stage 0 (no ZeRO optimizer) its optimizer state is a torch optimizer state_dict in
mp_rank_*'s `optimizer`, by parameter index, in the order of Megatron's param groups (weight-decayed
parameters, then biases and 1-D parameters, each in module order).

Its client state differs from ours: no `train_state` (the iteration, `args.consumed_train_samples` and
DeepSpeed's `skipped_steps` hold it), and its scheduler counts samples (`num_steps` = samples consumed).
"""
from __future__ import annotations

import re
from collections import OrderedDict
from typing import Dict, Optional

import torch

from ..model.layer_indices import block_layer_index, block_number, final_norm_index, is_block_index, lm_head_index
from ..model.params import (LM_HEAD_SUFFIX, POSITION_EMBEDDINGS, UNTIED_POSITION_EMBEDDINGS, UNTIED_WORD_EMBEDDINGS,
                            WORD_EMBEDDINGS)
from .errors import CheckpointError
from .format import header_args

MODULE_PREFIX = "language_model."
WORD = "language_model.embedding.word_embeddings.weight"
POSITIONS = "language_model.embedding.position_embeddings.weight"
OUTPUT_LAYER = "language_model.output_layer.weight"
_LAYER = re.compile(r"^language_model\.encoder\.layers\.(\d+)\.(.+)$")
_FINAL_NORM = re.compile(r"^language_model\.encoder\.final_layernorm\.(weight|bias)$")


def is_module_layout(names) -> bool:
    """Do these parameter names come from Megatron-DeepSpeed's non-pipeline model?"""
    return any(n.startswith(MODULE_PREFIX) for n in names)


def ours_from_module_name(name: str, num_layers: int, tied: bool) -> str:
    """Our (pipeline) name of a Megatron-DeepSpeed non-pipeline parameter name."""
    if name == WORD:
        return WORD_EMBEDDINGS if tied else UNTIED_WORD_EMBEDDINGS
    if name == POSITIONS:
        return POSITION_EMBEDDINGS if tied else UNTIED_POSITION_EMBEDDINGS
    if name == OUTPUT_LAYER:
        return f"{lm_head_index(num_layers)}.{LM_HEAD_SUFFIX}"
    m = _LAYER.match(name)
    if m:
        return f"{block_layer_index(int(m.group(1)))}.{m.group(2)}"
    m = _FINAL_NORM.match(name)
    if m:
        return f"{final_norm_index(num_layers)}.{m.group(1)}"
    raise CheckpointError(f"the Megatron-DeepSpeed parameter {name} has no counterpart in this GPT")


def module_name_from_ours(name: str, num_layers: int) -> str:
    """Megatron-DeepSpeed's non-pipeline name of one of our parameter names."""
    if name in (WORD_EMBEDDINGS, UNTIED_WORD_EMBEDDINGS):
        return WORD
    if name in (POSITION_EMBEDDINGS, UNTIED_POSITION_EMBEDDINGS):
        return POSITIONS
    index, _, suffix = name.partition(".")
    i = int(index)
    if i == lm_head_index(num_layers) and suffix == LM_HEAD_SUFFIX:
        return OUTPUT_LAYER
    if is_block_index(i, num_layers):
        return f"language_model.encoder.layers.{block_number(i)}.{suffix}"
    if i == final_norm_index(num_layers):
        return f"language_model.encoder.final_layernorm.{suffix}"
    raise ValueError(f"{name!r} has no Megatron-DeepSpeed non-pipeline name")


def flatten_module(module: dict, prefix: str = "") -> "OrderedDict[str, object]":
    """The nested `module` dict of a non-pipeline model-states file as dotted names -> tensors, in order."""
    out = OrderedDict()
    for key, value in module.items():
        if isinstance(value, dict):
            out.update(flatten_module(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def nest_module(flat: Dict[str, object]) -> dict:
    """Dotted non-pipeline names -> the nesting Megatron's GPTModel.load_state_dict takes: language_model ->
    embedding -> word_embeddings / position_embeddings -> {weight}, encoder -> {layers.k...: tensor},
    output_layer -> {weight}."""
    lm: dict = {}
    for name, tensor in flat.items():
        rest = name[len(MODULE_PREFIX):]
        part, _, tail = rest.partition(".")
        if part == "embedding":
            table, _, leaf = tail.partition(".")
            lm.setdefault("embedding", OrderedDict()).setdefault(table, OrderedDict())[leaf] = tensor
        elif part == "encoder":
            lm.setdefault("encoder", OrderedDict())[tail] = tensor
        else:
            lm.setdefault(part, OrderedDict())[tail] = tensor
    return OrderedDict(language_model=lm)


QKV_SUFFIXES = ("self_attention.query_key_value.weight", "self_attention.query_key_value.bias")


def writes_qkv_blocks(head: dict) -> bool:
    """Was this checkpoint written for Megatron-DeepSpeed's attention, whose fused QKV holds, on each TP rank,
    [Q of its heads; K of its groups; V of its groups] (ours: per query group [q heads, k, v])? Megatron-DeepSpeed
    records Megatron's `args.model_type`; ours records it only when it writes for Megatron-DeepSpeed."""
    return header_args(head).get("model_type") is not None


def qkv_heads(head: dict, tp: int):
    """(attention heads, query groups) per TP rank of the model a header's args describe."""
    args = header_args(head)
    heads = int(args["num_attention_heads"])
    groups = int(args.get("num_key_value_heads") or args.get("num_query_groups") or heads)
    if heads % tp or groups % tp:
        raise CheckpointError(f"a Megatron-DeepSpeed checkpoint with {heads} heads and {groups} key-value heads "
                              f"cannot be split over TP={tp}")
    return heads // tp, groups // tp


def qkv_to_ours(t, heads: int, groups: int):
    """One TP rank's fused QKV rows [Q; K; V] (Megatron-DeepSpeed) as ours: per group [q heads, k, v]."""
    rest = tuple(t.shape[1:])
    hn = t.shape[0] // (heads + 2 * groups)
    q, k, v = t.split([heads * hn, groups * hn, groups * hn])
    return torch.cat([q.reshape(groups, heads // groups, hn, *rest), k.reshape(groups, 1, hn, *rest),
                      v.reshape(groups, 1, hn, *rest)], dim=1).reshape(t.shape)


def qkv_from_ours(t, heads: int, groups: int):
    """The inverse of qkv_to_ours: our per-group QKV rows as Megatron-DeepSpeed's [Q; K; V]."""
    rest = tuple(t.shape[1:])
    per = heads // groups
    g = t.reshape(groups, per + 2, t.shape[0] // (heads + 2 * groups), *rest)
    return torch.cat([g[:, :per].reshape(-1, *rest), g[:, per].reshape(-1, *rest),
                      g[:, per + 1].reshape(-1, *rest)]).reshape(t.shape)


def is_megatron_deepspeed_client(client: dict) -> bool:
    """A client state in Megatron-DeepSpeed's terms: written by it (no `train_state`; ours always has one) or
    by ours for it (its scheduler's state, which counts samples: `start_wd` is its key)."""
    scheduler = client.get("lr_scheduler") or {}
    return ("train_state" not in client and "iteration" in client) or "start_wd" in scheduler


def client_from_megatron_deepspeed(head: dict) -> dict:
    """Our client state (train_state, lr_scheduler in iterations, rng_state, args) from an MDS header
    (its rng_state already resolved to this rank's entry)."""
    args = header_args(head)
    iteration = int(head.get("iteration", head.get("global_steps", 0)) or 0)
    consumed = args.get("consumed_train_samples")
    if consumed is None:
        consumed = head.get("global_samples", 0)
    scheduler = dict(head.get("lr_scheduler") or {})
    scheduler["num_steps"] = iteration  # MDS counts samples; ours counts iterations
    client = {k: v for k, v in head.items() if k not in ("module", "optimizer", "param_shapes")}
    client["rng_state"] = rng_from_megatron_deepspeed(client.get("rng_state"))
    train_state = {"iteration": iteration, "consumed_train_samples": int(consumed),
                   "skipped_iterations": int(head.get("skipped_steps", 0) or 0), "nan_iterations": 0}
    train_state.update(head.get("train_state") or {})  # ours, saved for Megatron-DeepSpeed, keeps its own
    client.update(iteration=iteration, consumed_train_samples=int(consumed), lr_scheduler=scheduler,
                  train_state=train_state)
    return client


def num_layers_of(head: dict, names) -> int:
    """The transformer layer count an MDS header records (its args), or counted from the names."""
    n = header_args(head).get("num_layers")
    if n:
        return int(n)
    found = {int(m.group(1)) for m in map(_LAYER.match, names) if m}
    if not found:
        raise CheckpointError("a Megatron-DeepSpeed checkpoint without args and without encoder layers")
    return max(found) + 1


def untied(head: dict, names) -> bool:
    args = header_args(head)
    return bool(args.get("untie_embeddings_and_output_weights")) or OUTPUT_LAYER in names


def ours_names(head: dict, names) -> "OrderedDict[str, str]":
    """our name -> the file's, for every name of a non-pipeline model (identity for others)."""
    names = list(names)
    if not is_module_layout(names):
        return OrderedDict((n, n) for n in names)
    layers, tied = num_layers_of(head, names), not untied(head, names)
    return OrderedDict((ours_from_module_name(n, layers, tied), n) for n in names)


CPU_RNG_STATE_BYTES = 5056  # torch's CPU generator (MT19937) state; a CUDA (Philox) state is 16 bytes


def rng_from_megatron_deepspeed(state: Optional[dict]) -> Optional[dict]:
    """Megatron's rng_state entry (tracker states as one accelerator ByteTensor each) as ours (tracker states
    as {'cpu': ..., ['cuda': ...]}); a CUDA state is paired with this process's current CPU state."""
    if not isinstance(state, dict) or "rng_tracker_states" not in state:
        return state
    tracker = {}
    for name, value in (state["rng_tracker_states"] or {}).items():
        if isinstance(value, dict):
            tracker[name] = value
        elif value.numel() == CPU_RNG_STATE_BYTES:
            tracker[name] = {"cpu": value}
        else:
            tracker[name] = {"cpu": state["torch_rng_state"], "cuda": value}
    return {**state, "rng_tracker_states": tracker}
