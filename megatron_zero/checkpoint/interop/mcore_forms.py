"""Where a torch_dist checkpoint holds a tensor mcore_names.py places: Megatron-Core writes a block's tensor in
one of three forms, and a rank reading one parameter finds whichever this checkpoint has.

    parts = locate(tensors, key, index)   # [(fqn, index, dims), ...] read and concatenated on dim 0, or None

    stacked      decoder.layers.<suffix>                [L, (E,) ...]   every layer alike (the default)
    per layer    decoder.layers.<i>.<suffix>            [(E,) ...]      --moe-layer-freq > 1 (dense and MoE
                                                                        blocks mixed), or singleton_local_shards
    per expert   decoder.layers.<i>.mlp.experts.experts.<e>.linear_fc1.weight        singleton_local_shards
    GLU halves   <any of those>_w, <any of those>_v     [gate], [up]    singleton_local_shards with SwiGLU

`index` is mcore_location's (layer[, expert]); `dims` the sizes the saved tensor's leading dimensions must
have for that index ((num_layers, num_experts) for the stacked expert form), which the caller checks. A norm
before an MoE layer is `mlp.linear_fc1.layer_norm_*` under the local spec, `pre_mlp_layernorm.*` under the
Transformer-Engine spec: both are looked for.
"""
from __future__ import annotations

from typing import Iterator, List, Optional, Tuple

from .mcore_names import EXPERTS, LAYERS

NORM_ALIASES = {"mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
                "mlp.linear_fc1.layer_norm_bias": "pre_mlp_layernorm.bias"}
Part = Tuple[str, Tuple[int, ...], Tuple[int, ...]]


def _forms(key: str, index: Tuple[int, ...], num_layers: int, num_experts: Optional[int]) -> Iterator[Part]:
    expert = len(index) > 1
    dims = (num_layers,) + ((num_experts,) if expert else ())
    yield key, index, dims[:len(index)]
    if not key.startswith(LAYERS) or not index:
        return
    suffix, layer, rest = key[len(LAYERS):], index[0], index[1:]
    yield f"{LAYERS}{layer}.{suffix}", rest, dims[1:len(index)]
    if expert and suffix.startswith(EXPERTS):
        yield f"{LAYERS}{layer}.{EXPERTS}{rest[0]}.{suffix[len(EXPERTS):]}", rest[1:], ()


def locate(tensors, key: str, index: Tuple[int, ...], num_layers: int,
           num_experts: Optional[int] = None) -> Optional[List[Part]]:
    keys = [key]
    if key.startswith(LAYERS) and key[len(LAYERS):] in NORM_ALIASES:
        keys.append(LAYERS + NORM_ALIASES[key[len(LAYERS):]])
    for k in keys:
        for fqn, idx, dims in _forms(k, index, num_layers, num_experts):
            if fqn in tensors:
                return [(fqn, idx, dims)]
            if f"{fqn}_w" in tensors and f"{fqn}_v" in tensors:
                return [(f"{fqn}_w", idx, dims), (f"{fqn}_v", idx, dims)]
    return None
