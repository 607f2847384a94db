"""ZeRO-1/2's weight all-gather with the FP8 layers' weights in FP8 (--fp8-param-gather), on the bf16 layout.

The partitions stay DeepSpeed's (partition.py: a group's parameters concatenated, cut into `dp` equal
ranges), so the masters, the optimizer state and the checkpoints are those of a run without the flag. What
changes is what a rank sends: instead of its partition in the training dtype (all_gather_into_tensor of the
flat buffer, in place), a packed row of bytes, its partition's fragments in order, each as

    a fragment of an FP8 layer's weight: the fp32 master cast to FP8 with the whole weight's scale
        (fp8/param_gather.py), 1 byte an element;
    any other fragment: the weight in the training dtype, its bytes (2 an element in bf16);

padding not sent. Every rank knows every rank's fragments (the partition layout), so the rows need no
header. The rows differ in length (a partition of FP8 weights is half as long as one of the embedding), so
they are not padded to the longest, which would send a whole bf16 row again wherever one rank's partition
holds no FP8 weight (DP64 on Llama-3-8B's layout): they are all-gathered as rows of their own lengths
(`all_gather_rows`: NCCL's all_gather takes such rows, broadcasting each, coalesced; on other backends one
broadcast a row), each rounded up to 16 bytes, into one uint8 buffer per group. Landing a parameter
copies its fragments out of the gathered rows: an FP8 weight's into its FP8 tensor, another's into the
parameter (this rank's own already there: `pack` wrote it). One extra buffer per group while the gather is
under way: the gathered rows, about the size of the FP8 weights plus the other weights.

The weights in the training dtype are held apart from the partition layout (`hold_apart`): the other
parameters as views of one buffer of their own, the FP8 weights not at all between publications (the FP8
weight is their one copy, fp8/param_gather.py), so no rank holds a flat buffer of the whole group.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from ..distributed import shm_comm
from .partition import GroupPartition

ROW_ALIGN = 16


@dataclass(frozen=True)
class Fragment:
    pi: int  # the parameter's index in its group
    in_param: int  # element offset in the parameter
    in_part: int  # element offset in the rank's partition
    numel: int
    at: int  # byte offset in the rank's packed row
    nbytes: int
    layer: Optional[int]  # the FP8 layer whose weight it is (Float8ParamGather's index), or None


class PackedGroup:
    """One param group's packed rows: each rank's fragments and where they lie in its row."""

    def __init__(self, part: GroupPartition, layers: Sequence[Optional[int]], itemsize: int):
        self.rows: List[List[Fragment]] = []
        for r in range(part.dp):
            at, row = 0, []
            for pi, a, s, n in part.param_ranges(r):
                nbytes = n * (1 if layers[pi] is not None else itemsize)
                row.append(Fragment(pi, a, s, n, at, nbytes, layers[pi]))
                at += nbytes
            self.rows.append(row)
        ends = [max((f.at + f.nbytes for f in row), default=0) for row in self.rows]
        self.row_bytes = [max(ROW_ALIGN, -(-end // ROW_ALIGN) * ROW_ALIGN) for end in ends]
        self.row_at = [sum(self.row_bytes[:r]) for r in range(part.dp)]  # where each row lies in the buffer
        self.total_bytes = sum(self.row_bytes)
        self.of_param: Dict[int, List[Tuple[int, Fragment]]] = {}
        for r, row in enumerate(self.rows):
            for f in row:
                self.of_param.setdefault(f.pi, []).append((r, f))
        self.fp8_numel = sum(f.numel for row in self.rows for f in row if f.layer is not None)


def hold_apart(params: Sequence[torch.nn.Parameter], part: GroupPartition, flat: torch.Tensor, fp8) -> torch.Tensor:
    """The group's weights (`flat`: all of them in the partition layout, the training dtype) held apart: the
    parameters other than `fp8`'s layers' weights become views of one buffer of their own (returned), each FP8
    weight a tensor of its own until its first FP8 publication drops it (Float8ParamGather.release)."""
    others = [(p, off, n) for p, off, n in zip(params, part.offsets, part.numels) if fp8.layer_of(p) is None]
    buffer = flat.new_empty(sum(n for _, _, n in others))
    at = 0
    for p, off, n in zip(params, part.offsets, part.numels):
        if fp8.layer_of(p) is not None:
            p.data = flat[off:off + n].view(p.shape).clone()
        else:
            buffer[at:at + n].copy_(flat[off:off + n])
            p.data = buffer[at:at + n].view(p.shape)
            at += n
    return buffer


class PackedGather:
    """The packed gather of a Stage12's groups; `fp8`: fp8/param_gather.Float8ParamGather."""

    def __init__(self, parts: Sequence[GroupPartition], groups: Sequence[Sequence[torch.nn.Parameter]], fp8,
                 rank: int, itemsize: int):
        self.gather8, self.rank, self.params = fp8, rank, groups
        self.groups = [PackedGroup(part, [fp8.layer_of(p) for p in params], itemsize)
                       for part, params in zip(parts, groups)]
        # this rank's fragments of FP8 weights (group, fragment), and their layers on the device
        self.mine = [(gi, f) for gi, g in enumerate(self.groups) for f in g.rows[rank] if f.layer is not None]
        self.mine_index = fp8.fragment_index(f.layer for _, f in self.mine)

    def _weight(self, gi: int, f: Fragment) -> torch.Tensor:
        """Fragment f's elements of its (non-FP8) parameter, flat."""
        return self.params[gi][f.pi].data.view(-1)[f.in_param:f.in_param + f.numel]

    @torch.no_grad()
    def pack(self, masters: Sequence[torch.Tensor]) -> List[torch.Tensor]:
        """This rank's packed row of each group. `masters`: its updated fp32 partitions (on the device, or on
        the host with --cpu-optimizer): the FP8 fragments cast from them, the others written into their
        parameters in the training dtype and sent from there. The FP8 weights' scales are set first (one
        all-reduce of their amaxes)."""
        device = self.gather8.device
        self.gather8.scales_from_fragments([masters[gi][f.in_part:f.in_part + f.numel] for gi, f in self.mine],
                                       self.mine_index)
        rows = []
        for gi, g in enumerate(self.groups):
            row = torch.zeros(g.row_bytes[self.rank], dtype=torch.uint8, device=device)
            for f in g.rows[self.rank]:
                master = masters[gi][f.in_part:f.in_part + f.numel]
                if f.layer is not None:
                    row[f.at:f.at + f.nbytes].copy_(self.gather8.cast(f.layer, master))
                else:
                    mine = self._weight(gi, f)
                    mine.copy_(master)  # a cast to the training dtype (a master held on the host comes up)
                    row[f.at:f.at + f.nbytes].copy_(mine.view(torch.uint8))
            rows.append(row)
        return rows

    @torch.no_grad()
    def land(self, gi: int, pi: int, gathered: torch.Tensor) -> None:
        """Copy parameter pi of group gi out of the gathered rows (`gathered`: every rank's row in rank order):
        an FP8 weight into its FP8 tensor, another into the parameter (this rank's fragment is there already)."""
        for r, f in self.groups[gi].of_param.get(pi, ()):
            at = self.groups[gi].row_at[r] + f.at
            src = gathered[at:at + f.nbytes]
            if f.layer is not None:
                self.gather8.bytes_of(f.layer)[f.in_param:f.in_param + f.numel].copy_(src)
            elif r != self.rank:
                self._weight(gi, f).view(torch.uint8).copy_(src)

    def rows_of(self, gi: int, gathered: torch.Tensor, lo: int = 0, hi: Optional[int] = None) -> List[torch.Tensor]:
        """Bytes [lo, hi) of each rank's row of group gi in the gathered buffer (empty past a row's end)."""
        g = self.groups[gi]
        return [gathered[at + min(lo, n):at + (n if hi is None else min(hi, n))] for at, n in zip(g.row_at, g.row_bytes)]

    def byte_range(self, gi: int, pi: int) -> List[Tuple[int, int, int]]:
        """(rank, first byte, end byte) of parameter pi's fragments in the packed rows of group gi."""
        return [(r, f.at, f.at + f.nbytes) for r, f in self.groups[gi].of_param.get(pi, ())]


class _Works:
    def __init__(self, works):
        self.works = works

    def wait(self):
        for w in self.works:
            w.wait()


def all_gather_rows(outs: List[torch.Tensor], mine: torch.Tensor, group, async_op: bool = False):
    """dist.all_gather of 1-D rows that may differ in length (`outs[r]`: rank r's, `mine`: this rank's): rows of
    one length through shm_comm (blocking) or torch.distributed; of several, NCCL's all_gather (which takes
    them: one broadcast a row, coalesced) or one broadcast a row (gloo's all_gather takes one length only).
    -> the work to wait for (async_op), else None."""
    if len({o.numel() for o in outs}) == 1:
        if async_op:
            return dist.all_gather(outs, mine, group=group, async_op=True)
        shm_comm.all_gather(outs, mine, group)
        return None
    if dist.get_backend(group) == "nccl":
        return dist.all_gather(outs, mine, group=group, async_op=async_op)
    outs[dist.get_rank(group)].copy_(mine)
    works = [dist.broadcast(out, src=dist.get_global_rank(group, r) if group is not None else r, group=group,
                            async_op=async_op)
             for r, out in enumerate(outs) if out.numel()]  # every rank knows every row's length
    return _Works(works) if async_op else None
