"""Autograd functions that move tensors into and out of the tensor-parallel region.

    copy_to   : forward identity,           backward all-reduce (sum)
    reduce_from: forward all-reduce (sum),  backward identity
    scatter_to: forward keep my last-dim chunk, backward all-gather last dim
    gather_from: forward all-gather last dim,   backward keep my chunk
    all_gather_last_dim: forward all-gather last dim, backward reduce-scatter last dim
                 (every rank uses a different part of the gathered tensor: grouped-query
                 attention with fewer KV groups than TP ranks)

Sequence parallelism (Megatron's scheme) keeps the LayerNorm / dropout regions split
along the sequence dimension, which is dim 1 of our batch-first [b, s, h] activations:

    scatter_to_sequence_parallel : forward keep my seq chunk,  backward all-gather seq
    gather_from_sequence_parallel: forward all-gather seq,     backward reduce-scatter seq
                                   (or keep my chunk when the consumer's grad is not TP-partial)
    reduce_scatter_to_sequence_parallel: forward reduce-scatter seq, backward all-gather seq

`group=None` (or a group of one rank) makes every mapping the identity.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .. import shm_comm
from ..reduce_scatter import reduce_scatter
from .utils import split_along_dim, tp_rank_in, tp_world_size


def _all_reduce(x, group):
    x = x.clone()
    shm_comm.all_reduce(x, group)
    return x


SEQUENCE_DIM = 1  # activations are [b, s, h]


def _split(x, group, dim=-1):
    return split_along_dim(x, tp_world_size(group), tp_rank_in(group), dim=dim)


def _gather(x, group, dim=-1):
    parts = [torch.empty_like(x, memory_format=torch.contiguous_format) for _ in range(tp_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def _reduce_scatter(x, group, dim):
    parts = [p.contiguous() for p in x.chunk(tp_world_size(group), dim=dim)]
    out = torch.empty_like(parts[0])
    reduce_scatter(out, parts, group=group)
    return out


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
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return _split(x, group, dim)

    @staticmethod
    def backward(ctx, grad):
        return _gather(grad, ctx.group, ctx.dim), None, None


class _GatherFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim, output_grad_is_partial):
        ctx.group, ctx.dim, ctx.partial = group, dim, output_grad_is_partial
        return _gather(x, group, dim)

    @staticmethod
    def backward(ctx, grad):
        if ctx.partial:
            return _reduce_scatter(grad, ctx.group, ctx.dim), None, None, None
        return _split(grad, ctx.group, ctx.dim), None, None, None


class _ReduceScatterToSequenceParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter(x, group, SEQUENCE_DIM)

    @staticmethod
    def backward(ctx, grad):
        return _gather(grad, ctx.group, SEQUENCE_DIM), None


class _AllGatherLastDim(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter(grad, ctx.group, -1), None


def _active(group) -> bool:
    return tp_world_size(group) > 1


def copy_to_tensor_model_parallel_region(x, group):
    return _CopyToRegion.apply(x, group) if _active(group) else x


def reduce_from_tensor_model_parallel_region(x, group):
    return _ReduceFromRegion.apply(x, group) if _active(group) else x


def scatter_to_tensor_model_parallel_region(x, group):
    return _ScatterToRegion.apply(x, group, -1) if _active(group) else x


def gather_from_tensor_model_parallel_region(x, group):
    return _GatherFromRegion.apply(x, group, -1, False) if _active(group) else x


def scatter_to_sequence_parallel_region(x, group):
    return _ScatterToRegion.apply(x, group, SEQUENCE_DIM) if _active(group) else x


def gather_from_sequence_parallel_region(x, group, tensor_parallel_output_grad=True):
    """All-gather the sequence. `tensor_parallel_output_grad`: the gradient arriving from the consumer
    (a column-parallel layer) is this rank's partial sum, so backward reduce-scatters it."""
    return _GatherFromRegion.apply(x, group, SEQUENCE_DIM, tensor_parallel_output_grad) if _active(group) else x


def reduce_scatter_to_sequence_parallel_region(x, group):
    return _ReduceScatterToSequenceParallel.apply(x, group) if _active(group) else x


def all_gather_last_dim_from_tensor_parallel_region(x, group):
    return _AllGatherLastDim.apply(x, group) if _active(group) else x
