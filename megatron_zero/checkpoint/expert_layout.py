"""Expert weights in DeepSpeed-MoE's file layout, beside the layer files:

    layer_{M}_expert_{E}_mp_rank_{mp:02d}_model_states.pt     {full parameter name: tensor}

M counts the model's MoE layers from 0 (DeepSpeed's moe_layer_id; an MoE multi-token prediction depth k's
layer after the blocks', as Megatron-Core numbers it), E is the global expert id, mp the
model-parallel rank (TP x PP) as in every other file; the names inside carry the global expert id
(`{i}.mlp.deepspeed_moe.experts.deepspeed_experts.{E}.*`, an MTP depth's
`{L+4}.{k}.transformer_layer.mlp.deepspeed_moe.experts.deepspeed_experts.{E}.*`). The layer files hold everything else of a
block, the router included. Each expert's files are written by the first rank of its
expert-data-parallel group, and read by every rank holding that expert. At ZeRO-3 (no layer files: the
weights load from the fp32 masters) the expert files are written too, each MoE layer's experts gathered
over expert-DP in turn (`zero3_expert_files`): they name the experts for the reshape readers and hold
DeepSpeed-MoE's per-expert weights. The optimizer files keep
DeepSpeed's per-rank names: with expert parallelism each holds the dense groups' partition (over DP)
then the expert groups' (over expert-DP) (zero/expert_stage.py).
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Dict, Tuple

from ..model.layer_indices import block_number, is_block_index, mtp_index
from ..model.params import parse_expert_suffix
from .format import expert_file_name


def is_expert_param(name: str) -> bool:
    index, _, suffix = name.partition(".")
    return index.isdigit() and parse_expert_suffix(suffix) is not None


def moe_layer_id(config, layer_index: int, mtp_depth: int = 0) -> int:
    """The ordinal of block `layer_index` among the model's MoE layers; of the multi-token prediction layer
    (`layer_index` L+4), depth `mtp_depth`'s: after every block's (as Megatron-Core numbers its MTP layers)."""
    if layer_index == mtp_index(config.num_layers):
        return sum(config.is_moe_layer(b) for b in range(config.num_layers)) + mtp_depth
    return sum(config.is_moe_layer(b) for b in range(block_number(layer_index)))


def expert_files(model_sd: Dict, config, mp_rank: int) -> "OrderedDict[str, OrderedDict]":
    """file name -> {name: tensor} for the experts in a stage's state dict."""
    out: "OrderedDict[str, OrderedDict]" = OrderedDict()
    for name, tensor in model_sd.items():
        if is_expert_param(name):
            layer, depth, expert = _layer_expert(name, config)
            out.setdefault(expert_file_name(moe_layer_id(config, layer, depth), expert, mp_rank),
                           OrderedDict())[name] = tensor
    return out


def zero3_expert_files(model, config, mp_rank: int, writes: bool) -> "OrderedDict[str, OrderedDict]":
    """expert_files of a ZeRO-3 model: collective over each expert's group (its stage, `p.ds_owner`), one MoE
    layer at a time; the rank that `writes` keeps copies of the gathered weights, the others nothing."""
    by_layer: "OrderedDict[str, list]" = OrderedDict()
    for name, p in model.named_parameters():
        if is_expert_param(name):
            by_layer.setdefault(name.partition(".")[0], []).append((name, p))
    weights: "OrderedDict[str, object]" = OrderedDict()
    for named in by_layer.values():
        owner = named[0][1].ds_owner
        with owner.gathered_params([p for _, p in named]):
            if writes:
                weights.update((n, p.detach().clone()) for n, p in named)
    return expert_files(weights, config, mp_rank) if writes else OrderedDict()


def _layer_expert(name: str, config) -> Tuple[int, int, int]:
    """(global layer index, MTP depth (0 for a block), expert id) of an expert parameter."""
    index, _, suffix = name.partition(".")
    layer = int(index)
    assert is_block_index(layer, config.num_layers) or layer == mtp_index(config.num_layers)
    depth = int(suffix.partition(".")[0]) if layer == mtp_index(config.num_layers) else 0
    return layer, depth, parse_expert_suffix(suffix)[0]


def without_experts(model_sd: Dict) -> "OrderedDict":
    return OrderedDict((k, v) for k, v in model_sd.items() if not is_expert_param(k))
