"""Global gradient norm across DP x TP x PP, and the overflow test, in one all-reduce pair.

Each rank sums the squares of the gradient elements it owns (its ZeRO partition) for
parameters that *count*: a TP-sharded parameter counts on every TP rank (each holds a
different slice); a TP-replicated one (layer norms, row-parallel biases) only on TP
rank 0, as Megatron's ``param_is_not_tensor_parallel_duplicate``; the last pipeline
stage's copy of the tied embedding (``param.shared``) never. Summing over the DP group
then the model-parallel group gives the squared norm of the whole model's gradient,
each element counted once. The overflow flag rides in the same tensor, so every rank
reaches the same skip decision.
"""
from __future__ import annotations

import math
from typing import Iterable, List, Optional, Tuple

import torch
import torch.distributed as dist

from ..device import HOST


def counts_in_norm(param: torch.Tensor, tp_rank: int) -> bool:
    """Does this rank's copy of ``param`` contribute to the global gradient norm?"""
    if getattr(param, "shared", False):
        return False
    if getattr(param, "tensor_model_parallel", False):
        return True
    return tp_rank == 0


def local_sums(grads: List[torch.Tensor], counted: List[List[Tuple[int, int]]]) -> torch.Tensor:
    """[sum of squares over counted fragments, number of tensors with a non-finite element] (fp64).

    A non-finite element of a counted fragment makes the sum of squares non-finite, so only a
    tensor with uncounted elements needs its own test: its fp64 sum, which finite fp32/16-bit
    values cannot overflow. Both are single passes that never materialise an fp64 copy.
    """
    device = grads[0].device if grads else HOST
    sq = torch.zeros((), dtype=torch.float64, device=device)
    bad = torch.zeros((), dtype=torch.float64, device=device)
    for g, frags in zip(grads, counted):
        for start, numel in frags:
            sq += torch.linalg.vector_norm(g.narrow(0, start, numel), dtype=torch.float64).square()
        if sum(numel for _, numel in frags) != g.numel():
            bad += (~torch.isfinite(g.sum(dtype=torch.float64))).double()
    return torch.stack([sq, bad])


def reduce_sums(sums: torch.Tensor, groups: Iterable[Optional[object]]) -> torch.Tensor:
    """All-reduce (SUM) ``sums`` over each group in turn (DP, then model-parallel)."""
    out = sums.clone()
    for group in groups:
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(out, group=group)
    return out


def norm_and_overflow(sums: torch.Tensor) -> Tuple[float, bool]:
    sq, bad = float(sums[0]), float(sums[1])
    overflow = bad > 0 or not math.isfinite(sq)
    return (math.sqrt(sq) if math.isfinite(sq) else float("inf")), overflow


def clip_coefficient(total_norm: float, max_norm: Optional[float]) -> float:
    """torch.nn.utils.clip_grad_norm_'s factor: max_norm / (norm + 1e-6), capped at 1."""
    if not max_norm or max_norm <= 0:
        return 1.0
    return min(1.0, max_norm / (total_norm + 1e-6))
