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

import bisect
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



# ---- stage 0-2 gradient buckets ------------------------------------------------

@dataclass(frozen=True)
class BucketLayout:
    """One gradient bucket of a stage 0-2 param group: ``dp`` rows of ``width`` elements, row r holding
    ``[lo[r], hi[r])`` of rank r's partition (zero-padded to ``width``), so the rows are one
    reduce-scatter's input and rank r's result is its ``[lo[r], hi[r])``. ``pieces``: where each
    parameter's gradient goes, as (param index, offset in the parameter, offset in the rows, numel)."""

    lo: Tuple[int, ...]
    hi: Tuple[int, ...]
    width: int
    pieces: Tuple[Tuple[int, int, int, int], ...]

    @property
    def params(self) -> Tuple[int, ...]:
        return tuple(sorted({i for i, _, _, _ in self.pieces}))


def _bucket(part: GroupPartition, lo: Sequence[int], hi: Sequence[int]) -> BucketLayout:
    width = max(end - start for start, end in zip(lo, hi))
    pieces = []
    for r, (start, end) in enumerate(zip(lo, hi)):
        a0, b0 = r * part.partition_size + start, r * part.partition_size + end
        first = max(0, bisect.bisect_right(part.offsets, a0) - 1)
        for i in range(first, bisect.bisect_left(part.offsets, b0)):
            off, n = part.offsets[i], part.numels[i]
            a, b = max(off, a0), min(off + n, b0)
            if a < b:
                pieces.append((i, a - off, r * width + a - a0, b - a))
    return BucketLayout(tuple(lo), tuple(hi), width, tuple(pieces))


def strided_buckets(part: GroupPartition, bucket_size: int) -> List[BucketLayout]:
    """Stages 0/1: bucket k is ``[k * c, (k + 1) * c)`` of every rank's partition, c = bucket_size / dp.
    Its rows have equal width: in the flat gradient buffer (parameter order) they are one strided view
    [dp, width], and rank r's result is a contiguous piece of its partition: the bytes of one
    reduce-scatter of the whole group. (A bucket is complete only once backward has
    reached its piece of the first partition: with this partition layout, which DeepSpeed's checkpoints
    fix, the buckets complete during the last 1/dp of backward.)"""
    size = part.partition_size
    chunk = max(1, -(-int(bucket_size) // part.dp))
    return [_bucket(part, (s,) * part.dp, (min(size, s + chunk),) * part.dp) for s in range(0, size, chunk)]


def contiguous_buckets(part: GroupPartition, bucket_size: int, alone: Sequence[int] = ()) -> List[BucketLayout]:
    """Stage 2: consecutive parameters, the last first (the order backward produces them), a bucket closed
    once it holds ``bucket_size`` elements; each parameter in ``alone`` gets a bucket of its own. A bucket
    is one range of the flat vector: row r is its intersection with rank r's partition."""
    alone, spans, current, held = set(alone), [], [], 0
    for i in reversed(range(len(part.numels))):
        if i in alone:
            spans += [current, [i]] if current else [[i]]
            current, held = [], 0
            continue
        current.append(i)
        held += part.numels[i]
        if held >= bucket_size:
            spans.append(current)
            current, held = [], 0
    if current:
        spans.append(current)
    out, size = [], part.partition_size
    for span in spans:
        a, b = part.offsets[span[-1]], part.offsets[span[0]] + part.numels[span[0]]
        lo = [min(size, max(0, a - r * size)) for r in range(part.dp)]
        hi = [min(size, max(0, b - r * size)) for r in range(part.dp)]
        hi = [max(start, end) for start, end in zip(lo, hi)]
        if b > a:
            out.append(_bucket(part, lo, hi))
    return out
