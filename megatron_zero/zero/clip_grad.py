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
from typing import Iterable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist


def counts_in_norm(param: torch.Tensor, tp_rank: int) -> bool:
    """Does this rank's copy of ``param`` contribute to the global gradient norm? (An expert's replicated
    parameter: its expert-tensor-parallel rank 0's copy, moe/layer.py.)"""
    if getattr(param, "shared", False):
        return False
    if getattr(param, "tensor_model_parallel", False):
        return True
    return getattr(param, "expert_tp_rank", tp_rank) == 0


def norms_fp64(tensors: List[torch.Tensor]) -> List[torch.Tensor]:
    """The L2 norm of each tensor, accumulated in fp64 without an fp64 copy: one multi-tensor kernel
    (torch._foreach_norm) where torch has it, else one torch.linalg.vector_norm per tensor."""
    if not tensors:
        return []
    foreach_norm = getattr(torch, "_foreach_norm", None)
    if foreach_norm is not None:
        try:
            return list(foreach_norm(tensors, 2, dtype=torch.float64))
        except (TypeError, RuntimeError):  # a torch whose foreach norm takes no dtype, or not these tensors
            pass
    return [torch.linalg.vector_norm(t, dtype=torch.float64) for t in tensors]


def local_sums(tensors: List[torch.Tensor], counted: List[List[Tuple[int, int]]], device: torch.device,
               votes: Sequence[float] = (), riders: Optional[torch.Tensor] = None) -> torch.Tensor:
    """[sum of squares over counted fragments, number of tensors with a non-finite element, *votes] (fp64),
    on `device`, ready for reduce_sums.

    A non-finite element of a counted fragment makes the sum of squares non-finite, so only a tensor with
    uncounted elements needs its own test: the fp64 norm of the whole tensor, which finite fp32/16-bit
    values cannot overflow. All norms are one multi-tensor pass. The tensors may live in host memory
    (offloaded fp32 masters): the sums are computed there and the few numbers copied to `device`, where
    the collective runs (NCCL reduces device tensors only). `votes` ride along to be summed over every
    rank by the same all-reduce (the exit policy's); `riders`, a device tensor, after them (the step's
    results the re-run machine checks: reliability/rerun.py), summed alike without a read of their own.
    """
    fragments = [t.narrow(0, start, numel) for t, frags in zip(tensors, counted) for start, numel in frags]
    partial = [t for t, frags in zip(tensors, counted) if sum(numel for _, numel in frags) != t.numel()]
    norms = norms_fp64(fragments + partial)
    if not norms:
        sums = torch.tensor([0.0, 0.0, *votes], dtype=torch.float64, device=device)
        return sums if riders is None else torch.cat([sums, riders.to(device, torch.float64)])
    by_fragment, by_partial = norms[:len(fragments)], norms[len(fragments):]
    home = norms[0].device
    sq = torch.stack(by_fragment).square().sum() if by_fragment else torch.zeros((), dtype=torch.float64,
                                                                                   device=home)
    bad = ((~torch.isfinite(torch.stack(by_partial))).sum().double() if by_partial
           else torch.zeros((), dtype=torch.float64, device=home))
    sums = torch.stack([sq, bad])
    if votes:
        sums = torch.cat([sums, torch.tensor(list(votes), dtype=torch.float64, device=home)])
    if riders is not None:
        sums = torch.cat([sums, riders.to(home, torch.float64)])
    return sums.to(device)


def reduce_sums(sums: torch.Tensor, groups: Iterable[Optional[object]]) -> torch.Tensor:
    """All-reduce (SUM) ``sums`` over each group in turn (DP, then model-parallel)."""
    out = sums.clone()
    for group in groups:
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(out, group=group)
    return out


def norm_and_overflow(sums: torch.Tensor) -> Tuple[float, bool, List[float]]:
    """(global norm, overflow, the summed votes) from reduce_sums' result: its one read back to the host."""
    sq, bad, *votes = sums.tolist()
    overflow = bad > 0 or not math.isfinite(sq)
    return (math.sqrt(sq) if math.isfinite(sq) else float("inf")), overflow, votes


def clip_coefficient(total_norm: float, max_norm: Optional[float]) -> float:
    """torch.nn.utils.clip_grad_norm_'s factor: max_norm / (norm + 1e-6), capped at 1."""
    if not max_norm or max_norm <= 0:
        return 1.0
    return min(1.0, max_norm / (total_norm + 1e-6))
