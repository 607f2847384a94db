"""Partition bookkeeping for ZeRO, as pure functions (no process group needed).

Stage 1/2 (DeepSpeed's layout, which its zero_to_fp32.py and ds_to_universal read):
a param group's parameters are concatenated in order into one flat vector, padded
at the end to a multiple of ``2 * dp`` (DeepSpeed's nccl_start_alignment_factor 2
times the DP size), and cut into ``dp`` equal partitions. Rank r owns
``[r * P, (r + 1) * P)``. A parameter's fragment on rank r is its intersection
with that range, given as ``start`` (offset inside r's partition) and ``numel``:
that is what a checkpoint writes as ``param_slice_mappings``.

Stage 3 (DeepSpeed's per-parameter partitioning): every parameter is cut into
``dp`` chunks of ``ceil(numel / dp)`` elements (the last padded with zeros); a
rank's flat group is the concatenation of its chunk of each parameter, in order.
"""
from __future__ import annotations

import math
import types
from collections import OrderedDict
from dataclasses import dataclass
from typing import List, Sequence, Tuple

NCCL_START_ALIGNMENT_FACTOR = 2


class fragment_address(types.SimpleNamespace):
    """DeepSpeed's ``fragment_address(numel, start)``: where a parameter lies in a flat partition.

    It pickles as a plain ``types.SimpleNamespace`` with the same two attributes, so a
    checkpoint holding it loads anywhere (DeepSpeed's tools, ours) with neither
    deepspeed nor megatron_zero importable; equality compares the two numbers.
    """

    def __init__(self, numel: int, start: int):
        super().__init__(numel=int(numel), start=int(start))

    def __reduce__(self):
        return (types.SimpleNamespace, (), dict(numel=self.numel, start=self.start))


@dataclass(frozen=True)
class GroupPartition:
    """How one param group's flat vector is laid out and split across ``dp`` ranks."""

    names: Tuple[str, ...]
    numels: Tuple[int, ...]
    offsets: Tuple[int, ...]      # where each parameter starts in the flat vector
    dp: int
    numel: int                    # sum of parameter sizes
    padded_numel: int             # rounded up to a multiple of 2 * dp
    partition_size: int           # padded_numel // dp

    def bounds(self, rank: int) -> Tuple[int, int]:
        """[start, end) of rank's partition in the flat vector."""
        _check_rank(rank, self.dp)
        return rank * self.partition_size, (rank + 1) * self.partition_size

    def padding(self, rank: int) -> int:
        """Zero elements at the end of rank's partition (DeepSpeed's ``groups_padding``)."""
        start, end = self.bounds(rank)
        return end - min(end, max(start, self.numel))

    def fragments(self, rank: int) -> "OrderedDict[str, fragment_address]":
        """name -> fragment in rank's partition, for each parameter that overlaps it, in order."""
        lo, hi = self.bounds(rank)
        out = OrderedDict()
        for name, off, n in zip(self.names, self.offsets, self.numels):
            a, b = max(off, lo), min(off + n, hi)
            if a < b:
                out[name] = fragment_address(numel=b - a, start=a - lo)
        return out

    def param_ranges(self, rank: int) -> List[Tuple[int, int, int, int]]:
        """(param index, offset in param, offset in partition, numel) for each overlap with rank."""
        lo, hi = self.bounds(rank)
        out = []
        for i, (off, n) in enumerate(zip(self.offsets, self.numels)):
            a, b = max(off, lo), min(off + n, hi)
            if a < b:
                out.append((i, a - off, a - lo, b - a))
        return out


def partition_group(named_numels: Sequence[Tuple[str, int]], dp: int) -> GroupPartition:
    """Lay out one param group (ordered (name, numel) pairs) over ``dp`` ranks."""
    if dp < 1:
        raise ValueError(f"the data-parallel size must be at least 1, got {dp}")
    names = tuple(n for n, _ in named_numels)
    numels = tuple(int(k) for _, k in named_numels)
    offsets, total = [], 0
    for k in numels:
        offsets.append(total)
        total += k
    align = NCCL_START_ALIGNMENT_FACTOR * dp
    padded = max(align, int(math.ceil(total / align)) * align)
    return GroupPartition(names, numels, tuple(offsets), dp, total, padded, padded // dp)


def partition_groups(groups: Sequence[Sequence[Tuple[str, int]]], dp: int) -> List[GroupPartition]:
    return [partition_group(g, dp) for g in groups]


def param_slice_mappings(groups: Sequence[Sequence[Tuple[str, int]]], dp: int,
                         rank: int) -> List["OrderedDict[str, fragment_address]"]:
    """What a ZeRO-1/2 checkpoint stores as ``param_slice_mappings`` for DP rank ``rank``."""
    return [p.fragments(rank) for p in partition_groups(groups, dp)]


def group_paddings(groups: Sequence[Sequence[Tuple[str, int]]], dp: int, rank: int) -> List[int]:
    """What a ZeRO-1/2 checkpoint stores as ``group_paddings`` for DP rank ``rank``."""
    return [p.padding(rank) for p in partition_groups(groups, dp)]


# ---- stage 3 -----------------------------------------------------------------

def zero3_param_partition(numel: int, dp: int) -> Tuple[int, int]:
    """(elements per rank, zero padding of the whole parameter), as DeepSpeed's zero_to_fp32 computes."""
    per_rank = int(math.ceil(numel / dp))
    return per_rank, per_rank * dp - numel


def zero3_group_offsets(named_numels: Sequence[Tuple[str, int]], dp: int) -> "OrderedDict[str, Tuple[int, int]]":
    """name -> (offset, per-rank numel) of each parameter's chunk inside every rank's flat group."""
    out, off = OrderedDict(), 0
    for name, n in named_numels:
        per_rank, _ = zero3_param_partition(int(n), dp)
        out[name] = (off, per_rank)
        off += per_rank
    return out


def _check_rank(rank: int, dp: int):
    if not 0 <= rank < dp:
        raise ValueError(f"data-parallel rank {rank} lies outside 0..{dp - 1}")

