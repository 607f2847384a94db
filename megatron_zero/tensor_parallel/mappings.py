"""Autograd functions that move tensors into and out of the tensor-parallel region.

    copy_to   : forward identity,           backward all-reduce (sum)
    reduce_from: forward all-reduce (sum),  backward identity
    scatter_to: forward keep my last-dim chunk, backward all-gather last dim
    gather_from: forward all-gather last dim,   backward keep my chunk
    all_gather_last_dim: forward all-gather last dim, backward reduce-scatter last dim
                 (every rank uses a different part of the gathered tensor: grouped-query
                 attention with fewer KV groups than TP ranks)

Sequence parallelism (Megatron's scheme) keeps the LayerNorm / dropout regions split
over the tokens. Megatron's activations are [s, b, h] and it splits dim 0; ours are [b, s, h],
and the equivalent first-dim split is of the tokens in memory order: rank r holds rows
[r * n, (r + 1) * n) of the activation seen as [b * s, h] (n = b * s / tp tokens, viewed as
[b, s / tp, h]; with b = 1 exactly Megatron's chunk of the sequence). Every op in the region
(LayerNorm, dropout, bias, residual add) is per token, so which tokens a rank holds does not
matter, and each rank's tokens are one contiguous block of the whole: the collectives are
`all_gather_into_tensor` / `reduce_scatter_tensor` straight between the shard and the whole,
and the split is a view. No activation is copied (shm_comm's shared memory on one host's gloo):

    scatter_to_sequence_parallel : forward keep my tokens (a view), backward all-gather tokens
    gather_from_sequence_parallel: forward all-gather tokens,       backward reduce-scatter tokens
                                   (or keep my tokens when the consumer's grad is not TP-partial)
    reduce_scatter_to_sequence_parallel: forward reduce-scatter tokens, backward all-gather tokens

`group=None` (or a group of one rank) makes every mapping the identity.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..distributed import shm_comm
from ..distributed.reduce_scatter import reduce_scatter
from .conjugate import conjugate_pair
from .utils import divide, split_along_dim, tp_rank_in, tp_world_size


def _all_reduce(x, group):
    x = x.clone()
    shm_comm.all_reduce(x, group)
    return x


def _shard_shape(whole: torch.Size, tp: int) -> tuple:
    return (whole[0], divide(whole[1], tp), *whole[2:])


def _whole_shape(shard: torch.Size, tp: int) -> tuple:
    return (shard[0], shard[1] * tp, *shard[2:])


def _split_tokens(x, group):
    """My tokens of [b, s, h]: chunk `rank` of its memory, viewed as [b, s / tp, h] (a view)."""
    tp = tp_world_size(group)
    return x.contiguous().view(tp, -1)[tp_rank_in(group)].view(_shard_shape(x.shape, tp))


def _gather_tokens(x, group):
    """Every rank's tokens, [b, s / tp, h] each, into one [b, s, h] (all_gather_into_tensor, no copy)."""
    tp = tp_world_size(group)
    out = torch.empty(_whole_shape(x.shape, tp), dtype=x.dtype, device=x.device)
    shm_comm.all_gather_into_tensor(out, x.contiguous(), group)
    return out


def _reduce_scatter_tokens(x, group):
    """The sum over ranks of [b, s, h], my tokens of it as [b, s / tp, h] (reduce_scatter_tensor, no copy)."""
    out = torch.empty(_shard_shape(x.shape, tp_world_size(group)), dtype=x.dtype, device=x.device)
    shm_comm.reduce_scatter_tensor(out, x.contiguous(), group)
    return out


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


def _identity(x, group):
    return x.view_as(x)


def _split_last(x, group):
    return _split(x, group, -1)


def _gather_last(x, group):
    return _gather(x, group, -1)


def _reduce_scatter_last(x, group):
    return _reduce_scatter(x, group, -1)


# each pair: the first's backward is the second's forward and the reverse (conjugate.py)
_CopyToRegion, _ReduceFromRegion = conjugate_pair(_identity, _all_reduce)
_ScatterToRegion, _GatherFromRegion = conjugate_pair(_split_last, _gather_last)
_ReduceScatterLastDim, _AllGatherLastDim = conjugate_pair(_reduce_scatter_last, _gather_last)
_ScatterToSequenceParallel, _GatherFromSequenceParallel = conjugate_pair(_split_tokens, _gather_tokens)
_ReduceScatterToSequenceParallel, _GatherPartialFromSequenceParallel = conjugate_pair(_reduce_scatter_tokens,
                                                                                     _gather_tokens)


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


def scatter_to_sequence_parallel_region(x, group):
    return _ScatterToSequenceParallel.apply(x, group) if _active(group) else x


def gather_from_sequence_parallel_region(x, group, tensor_parallel_output_grad=True):
    """All-gather the tokens. `tensor_parallel_output_grad`: the gradient arriving from the consumer
    (a column-parallel layer) is this rank's partial sum, so backward reduce-scatters it."""
    if not _active(group):
        return x
    gather = _GatherPartialFromSequenceParallel if tensor_parallel_output_grad else _GatherFromSequenceParallel
    return gather.apply(x, group)


def reduce_scatter_to_sequence_parallel_region(x, group):
    return _ReduceScatterToSequenceParallel.apply(x, group) if _active(group) else x


def all_gather_last_dim_from_tensor_parallel_region(x, group):
    return _AllGatherLastDim.apply(x, group) if _active(group) else x
