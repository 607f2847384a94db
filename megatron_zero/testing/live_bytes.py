"""Bytes a model's weights hold, counted from the tensors themselves (not from what ZeRO reports).

`weight_bytes(model, extra)`: the bytes of every distinct storage behind the model's parameters and buffers and
the `extra` tensors (ZeRO's shards, --fp8-param-gather's FP8 weights), each storage once however many views
of it there are. A weight --fp8-param-gather holds no bytes of (its placeholder, fp8/param_gather.py) counts its
one element of storage.
"""
from typing import Iterable

import torch


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """The bytes of the distinct storages behind `tensors`."""
    seen = {}
    for t in tensors:
        if t is None:
            continue
        s = t.untyped_storage()
        if s.nbytes():
            seen[(s.device, s.data_ptr())] = s.nbytes()
    return sum(seen.values())


def fp8_weights(model: torch.nn.Module):
    """The FP8 weights --fp8-param-gather holds (fp8/param_gather.Float8Weight.data), one a layer."""
    return [m.fp8.weight8.data for m in model.modules()
            if getattr(getattr(m, "fp8", None), "weight8", None) is not None]


def weight_bytes(model: torch.nn.Module, extra: Iterable[torch.Tensor] = ()) -> int:
    """Bytes of the storages of the model's parameters, buffers and FP8 weights, and of `extra`."""
    return storage_bytes([*model.parameters(), *model.buffers(), *fp8_weights(model), *extra])
