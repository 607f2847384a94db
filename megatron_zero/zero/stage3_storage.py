"""Where a ZeRO-3 gather puts the full parameters: one storage a flight, every parameter a view of it.

A flight (one coalesced all-gather, stage3_gather.py) brings a unit's parameters, in the module's order.
`lay_out` gives each a slot of its dp chunks (``p.ds_per * dp`` elements, partition.py's padded layout) starting
on a 16-byte boundary (stacked_weights.ALIGN_BYTES, grouped_mm's rule), one slot after another in one buffer;
``p.data`` is the first ``numel`` elements of its slot. The experts of an MoE layer follow one another there
with the same parameters each, so one matmul's expert weights lie equally spaced and aligned in one storage, and
moe/stacked_weights.py reads them as one [E, ...] view, as it reads ZeRO 0-2's flat buffer, instead of stacking
them. The same parameters gathered again (backward's re-gather) get the same layout.

`Placed` is the gathered-storage map's entry for one such storage: which parameter holds which element range,
and which are still gathered. The storage is freed when no parameter holds it any more: a flight's parameters
are one unit's and are released together; when only some of them are released (a parameter another holder
still counts on, ``p.ds_rc``), stage3_gather.py moves the rest into a storage of their own, so the released
ones' memory is freed at once. The saved-tensor hooks use `Placed.locate` to turn a saved tensor into the
parameter(s) it lies in and back (`rebuild`).
"""
from __future__ import annotations

from bisect import bisect_right
from typing import List, Optional, Sequence, Tuple

import torch

from ..moe.stacked_weights import ALIGN_BYTES


def lay_out(params: Sequence[torch.Tensor], dp: int, dtype: torch.dtype,
            device: torch.device) -> Tuple[torch.Tensor, List[int]]:
    """(buffer, starts): one uninitialized buffer, parameter i's slot of ds_per * dp elements at starts[i]."""
    item = dtype.itemsize
    unit = ALIGN_BYTES // item if ALIGN_BYTES % item == 0 else 1
    starts, pos = [], 0
    for p in params:
        pos = -(-pos // unit) * unit
        starts.append(pos)
        pos += p.ds_per * dp
    return torch.empty(pos, dtype=dtype, device=device), starts


class Placed:
    """The parameters placed in one storage: slot i is [starts[i], starts[i] + lengths[i]) of the storage."""
    __slots__ = ("params", "starts", "lengths", "held", "index")

    def __init__(self, params: Sequence[torch.Tensor], starts: Sequence[int], dp: int):
        self.params, self.starts = list(params), list(starts)
        self.lengths = [p.ds_per * dp for p in self.params]
        self.held = [True] * len(self.params)
        self.index = {id(p): i for i, p in enumerate(self.params)}

    def drop(self, p) -> None:
        self.held[self.index[id(p)]] = False

    def any_held(self) -> bool:
        return any(self.held)

    def still_held(self) -> List[torch.Tensor]:
        return [p for p, h in zip(self.params, self.held) if h]

    def locate(self, t: torch.Tensor) -> Optional[List[Tuple[torch.Tensor, int]]]:
        """[(parameter, its slot's start)] of every slot that `t`'s elements touch, in storage order, or None
        where `t` reaches outside the slots of held parameters (then it is saved as it is)."""
        if t.numel() == 0:
            return None
        lo = t.storage_offset()
        hi = lo + 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
        i = bisect_right(self.starts, lo) - 1
        if i < 0 or lo >= self.starts[i] + self.lengths[i]:
            return None  # begins in alignment padding
        out = []
        while i < len(self.starts) and self.starts[i] < hi:
            if not self.held[i]:
                return None
            out.append((self.params[i], self.starts[i]))
            i += 1
        return out


def rebuild(params: Sequence[torch.Tensor], rels: Sequence[int], size, stride, offset: int) -> torch.Tensor:
    """The tensor (size, stride, offset) over parameters placed rels[i] elements after the first's start: a view
    where they are placed so now (the same flight layout), else a copy of them laid out so."""
    base = params[0].data
    key = base.untyped_storage().data_ptr()
    if all(p.data.untyped_storage().data_ptr() == key and p.data.storage_offset() - base.storage_offset() == r
           for p, r in zip(params, rels)):
        return base.as_strided(size, stride, base.storage_offset() + offset)
    extent = offset + 1 + sum((n - 1) * s for n, s in zip(size, stride))
    buf = torch.zeros(max(extent, *(r + p.numel() for p, r in zip(params, rels))), dtype=base.dtype,
                      device=base.device)
    for p, r in zip(params, rels):
        buf[r:r + p.numel()].copy_(p.data.reshape(-1))
    return buf.as_strided(size, stride, offset)
