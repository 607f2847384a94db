"""Small helpers shared by the tensor-parallel layers: sizes, ranks, parameter attributes.

A TP-sharded parameter carries three attributes that the ZeRO optimizer and the
checkpoint code read (Megatron's names):

    param.tensor_model_parallel = True
    param.partition_dim         = 0 (column-parallel, vocab-parallel) or 1 (row-parallel)
    param.partition_stride      = 1

A TP-replicated parameter (layer norms, row-parallel biases, position embeddings)
carries `tensor_model_parallel = False`.
"""
from __future__ import annotations

import torch


def divide(numerator: int, denominator: int) -> int:
    if numerator % denominator != 0:
        raise ValueError(f"{numerator} is not divisible by the tensor-parallel size {denominator}")
    return numerator // denominator


def tp_world_size(group) -> int:
    """Size of a TP group; `None` means TP=1 (the single-process path)."""
    if group is None:
        return 1
    import torch.distributed as dist
    return dist.get_world_size(group)


def tp_rank_in(group) -> int:
    if group is None:
        return 0
    import torch.distributed as dist
    return dist.get_rank(group)


def set_tensor_model_parallel_attributes(param: torch.Tensor, is_parallel: bool,
                                         dim: int = 0, stride: int = 1) -> torch.Tensor:
    """Mark a parameter as TP-sharded along `dim`, or as replicated across TP."""
    param.tensor_model_parallel = bool(is_parallel)
    if is_parallel:
        param.partition_dim = dim
        param.partition_stride = stride
    return param


def param_is_tp_duplicate(param: torch.Tensor, tp_rank: int) -> bool:
    """True when this copy of the parameter repeats one held by TP rank 0 (count it once)."""
    return not getattr(param, "tensor_model_parallel", False) and tp_rank > 0


def split_along_dim(tensor: torch.Tensor, parts: int, rank: int, dim: int = -1) -> torch.Tensor:
    """The `rank`-th of `parts` equal contiguous chunks along `dim` (a contiguous copy)."""
    size = divide(tensor.shape[dim], parts)
    return tensor.narrow(dim, rank * size, size).contiguous()
