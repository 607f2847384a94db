"""What goes in each DeepSpeed / Megatron-DeepSpeed file, for our GPT (the names: format.py).

Files of one checkpoint (the pipeline engine's layout, for every PP size):
  layer_{idx:02d}-model_{tp:02d}-model_states.pt   a layer's weights, local names (ZeRO 0-2);
                                                   spread over the DP replicas of each stage
  mp_rank_{mp:02d}_model_states.pt                 engine + client state (DP rank 0 of each MP rank)
  zero_pp_rank_{dp}_mp_rank_{mp:02d}_model_states.pt   the same, one per DP rank, at ZeRO-3
  [bf16_]zero_pp_rank_{dp}_mp_rank_{mp:02d}_optim_states.pt   every rank's ZeRO state
`module` in the model-states file holds the persistent buffers only (weights live in the
layer files, or at ZeRO-3 in the optimizer's flat groups), so DeepSpeed's zero_to_fp32.py
finds the dict it expects.
"""
from __future__ import annotations

import re
from collections import OrderedDict
from typing import Dict, List, Optional, Tuple

import torch

from ..model.layer_indices import EMBEDDING_INDEX
from ..model.params import LM_HEAD_SUFFIX, position_embeddings_name, word_embeddings_name
from .format import DS_VERSION, PIPELINE_REPLICATED_PATTERNS, TO_AVERAGE_PATTERNS, UNIVERSAL_CHECKPOINT_VERSION, VOCAB_PATTERNS
from .reshape.universal_info import deepspeed_pattern_lists

EMBED_PREFIX = "tied_modules.embed."


def layer_of(name: str) -> Tuple[int, str]:
    """(global layer index, name inside the layer) of a parameter; the tied embedding is layer 1."""
    if name.startswith(EMBED_PREFIX):
        return EMBEDDING_INDEX, name[len(EMBED_PREFIX):]
    index, _, local = name.partition(".")
    if not index.isdigit():
        raise ValueError(f"{name!r} is not a pipeline-layer parameter name")
    return int(index), local


def layer_state_dicts(model_sd: Dict, layer_indices) -> "OrderedDict[int, OrderedDict]":
    """Split a stage's state dict into per-layer dicts with local names, for the layers the stage owns.

    A last stage's copy of the tied embedding is skipped: the first stage's layer_01 file holds it,
    as DeepSpeed's pipeline engine does (the head layer is a function of the tied module)."""
    owned = set(layer_indices)
    out: "OrderedDict[int, OrderedDict]" = OrderedDict()
    for name, tensor in model_sd.items():
        index, local = layer_of(name)
        if index in owned:
            out.setdefault(index, OrderedDict())[local] = tensor
    return out


def assign_layers_to_dp(layer_bytes: "OrderedDict[int, int]", dp: int) -> Dict[int, int]:
    """layer index -> DP rank that writes it: biggest layers first, each to the least-loaded replica."""
    load = [0] * dp
    owner = {}
    for index, nbytes in sorted(layer_bytes.items(), key=lambda kv: (-kv[1], kv[0])):
        r = min(range(dp), key=lambda k: (load[k], k))
        owner[index] = r
        load[r] += nbytes
    return owner


def universal_checkpoint_info(config, padded_vocab_size: int) -> dict:
    """Megatron-DeepSpeed's pattern lists, derived from our parameter catalogue for this model's config
    (reshape/universal_info.py's deepspeed_pattern_lists: every parameter's TP split, the MoE, MLA and MTP ones
    with them)."""
    word, positions = word_embeddings_name(config), position_embeddings_name(config)
    tied = not config.untie_embeddings_and_output_weights
    return {
        "universal_checkpoint_version": UNIVERSAL_CHECKPOINT_VERSION,
        "original_vocab_size": int(config.vocab_size),
        "padded_vocab_size": int(padded_vocab_size),
        VOCAB_PATTERNS: [re.escape(word)] + ([] if tied else [r"\d+\." + re.escape(LM_HEAD_SUFFIX)]),
        PIPELINE_REPLICATED_PATTERNS: [re.escape(n) for n in (word, positions) if n and tied],
        TO_AVERAGE_PATTERNS: [],
        **deepspeed_pattern_lists(config),
    }


def param_shapes(optimizer, named_params: Dict) -> List["OrderedDict"]:
    """Per optimizer group, name -> full local shape, in flat-buffer order (what zero_to_fp32 walks)."""
    out = []
    for names in optimizer.names:
        out.append(OrderedDict((n, torch.Size(getattr(named_params[n], "ds_shape", named_params[n].shape)))
                               for n in names))
    return out


def persistent_buffers(model) -> "OrderedDict":
    out = OrderedDict()

    def walk(module, prefix):
        for name, buf in module.named_buffers(recurse=False):
            if buf is not None and name not in module._non_persistent_buffers_set:
                out[prefix + name] = buf
        for name, child in module.named_children():
            walk(child, prefix + name + ".")

    walk(model, "")
    return out


def engine_state(model, optimizer, iteration: int, consumed_samples: int, dp: int, mp: int,
                 ds_config: dict, lr_scheduler: Optional[dict], skipped_steps: int = 0) -> dict:
    """The keys DeepSpeed's engine writes into a model-states file."""
    named = dict(model.named_parameters())
    buffers = persistent_buffers(model)
    stage = optimizer.stage
    frozen = OrderedDict() if stage >= 2 else None
    return dict(module=OrderedDict(buffers), buffer_names=list(buffers), optimizer=None,
                param_shapes=param_shapes(optimizer, named), frozen_param_shapes=frozen, shared_params={},
                frozen_param_fragments=frozen, lr_scheduler=lr_scheduler, data_sampler=None, random_ltd=None,
                skipped_steps=skipped_steps, global_steps=iteration, global_samples=consumed_samples,
                dp_world_size=dp, mp_world_size=mp, ds_config=ds_config, ds_version=DS_VERSION)

