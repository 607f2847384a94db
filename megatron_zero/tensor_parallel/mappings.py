"""Autograd functions that move tensors into and out of the tensor-parallel region.

    copy_to   : forward identity,           backward all-reduce (sum)
    reduce_from: forward all-reduce (sum),  backward identity
    scatter_to: forward keep my last-dim chunk, backward all-gather last dim
    gather_from: forward all-gather last dim,   backward keep my chunk
    all_gather_last_dim: forward all-gather last dim, backward reduce-scatter last dim
                 (every rank uses a different part of the gathered tensor: grouped-query
                 attention with fewer KV groups than TP ranks)

`group=None` (or a group of one rank) makes every mapping the identity.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .utils import split_along_dim, tp_rank_in, tp_world_size


def _all_reduce(x, group):
    x = x.clone()
    dist.all_reduce(x, group=group)
    return x


def _split_last(x, group):
    return split_along_dim(x, tp_world_size(group), tp_rank_in(group), dim=-1)


def _gather_last(x, group):
    parts = [torch.empty_like(x) for _ in range(tp_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ScatterToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split_last(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_last(grad, ctx.group), None


class _GatherFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather_last(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _split_last(grad, ctx.group), None


class _AllGatherLastDim(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather_last(x, group)

    @staticmethod
    def backward(ctx, grad):  # reduce-scatter as all-reduce + keep my chunk: gloo has no reduce_scatter
        return _split_last(_all_reduce(grad.contiguous(), ctx.group), ctx.group), None


def _active(group) -> bool:
    return tp_world_size(group) > 1


def copy_to_tensor_model_parallel_region(x, group):
    return _CopyToRegion.apply(x, group) if _active(group) else x


def reduce_from_tensor_model_parallel_region(x, group):
    return _ReduceFromRegion.apply(x, group) if _active(group) else x


def scatter_to_tensor_model_parallel_region(x, group):
    return _ScatterToRegion.apply(x, group) if _active(group) else x


def gather_from_tensor_model_parallel_region(x, group):
    return _GatherFromRegion.apply(x, group) if _active(group) else x


def all_gather_last_dim_from_tensor_parallel_region(x, group):
    return _AllGatherLastDim.apply(x, group) if _active(group) else x
