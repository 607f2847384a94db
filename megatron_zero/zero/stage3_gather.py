"""ZeRO stage 3's parameter gathering: coalesced all-gathers, release, prefetch, saved-tensor hooks.

A gather packs the rank's shards (``p.ds_shard``) of every not-yet-gathered parameter of a unit
into one flat buffer and issues a single all-gather of it (async when prefetching), as
DeepSpeed's ``all_gather_coalesced`` does. The result is rank-major ([dp, sum of chunks]);
finishing the gather copies each parameter's dp chunks into its slot of one storage for the
whole flight (stage3_storage.py: in the flight's order, 16-byte aligned, each parameter a
view), so each parameter's layout (dp chunks of ceil(numel/dp), partition.py) is the same as
gathering it on its own, and an MoE layer's experts lie equally spaced for grouped GEMM's
stacked view. With dp = 1 the shards go straight into their slots. A parameter whose gather
is under way points at its ``_Flight`` (``p.ds_inflight``); waiting for any parameter of a
flight finishes the whole flight. Releasing parameters frees their flight's storage once none
of it is held; parameters still held when the rest of their flight is released move to a
storage of their own (one copy of those), so a partial release frees memory too.
Persistent parameters (outside every unit, or at most ``persistence_threshold`` elements)
stay gathered; they are re-gathered together, in one all-gather, after each optimizer step.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.distributed as dist

from .stage3_storage import Placed, lay_out, rebuild

_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class _Flight:
    """One coalesced all-gather under way: its parameters, rank-major output buffer and work handle, and
    ``placed`` = (buffer, starts) where the work itself writes the parameters' slots (then ``out`` is None)."""
    __slots__ = ("params", "out", "work", "placed")

    def __init__(self, params, out, work, placed=None):
        self.params, self.out, self.work, self.placed = params, out, work, placed


class GatherMixin:
    """Needs: dtype, device, dp, dp_group, groups, unit_params, prefetch, _storage, _trace, _fpos, _bpos."""

    def _start(self, params):
        """Begin one all-gather of those of ``params`` that are neither gathered nor under way."""
        todo = [p for p in params if p.ds_inflight is None and p.data.numel() == 0]
        if not todo:
            return
        if self.dp > 1:
            flat = torch.cat([p.ds_shard for p in todo]) if len(todo) > 1 else todo[0].ds_shard
            flight = _Flight(todo, *self._all_gather_shards(flat))
        else:  # nothing to gather: the shards are the full parameters
            buffer, starts = lay_out(todo, 1, self.dtype, self.device)
            for p, start in zip(todo, starts):
                buffer[start:start + p.ds_per].copy_(p.ds_shard)
            flight = _Flight(todo, None, None, (buffer, starts))
        for p in todo:
            p.ds_inflight = flight
        self.gather_calls += 1

    def _all_gather_shards(self, flat):
        """Start the all-gather of ``flat`` over DP: -> (rank-major output, work with .wait())."""
        out = torch.empty(flat.numel() * self.dp, dtype=self.dtype, device=self.device)
        self.comm_bytes["all_gather"] += flat.numel() * flat.element_size() * (self.dp - 1)
        return out, _all_gather(out, flat, group=self.dp_group, async_op=True)

    def _finish(self, flight):
        if flight.work is not None:
            flight.work.wait()
            flight.work = None
        if flight.placed is None and len(flight.params) == 1:  # rank-major of one parameter is its own layout
            flight.placed = flight.out, [0]
        elif flight.placed is None:  # the unpack: each parameter's dp chunks into its slot
            buffer, starts = lay_out(flight.params, self.dp, self.dtype, self.device)
            rows, pos = flight.out.view(self.dp, -1), 0
            for p, start in zip(flight.params, starts):
                buffer[start:start + p.ds_per * self.dp].view(self.dp, p.ds_per).copy_(rows[:, pos:pos + p.ds_per])
                pos += p.ds_per
            flight.placed = buffer, starts
        for p in flight.params:
            p.ds_inflight = None
        self._place(flight.params, *flight.placed)
        flight.out = flight.placed = None
        self.peak_param_numel = max(self.peak_param_numel, self.gathered_numel())

    def _place(self, params, buffer, starts):
        """Every one of ``params`` a view of its slot of ``buffer``; the storage entered in the saved-tensor map."""
        for p, start in zip(params, starts):
            p.data = buffer[start:start + p.ds_numel].view(p.ds_shape)
        self._storage[buffer.untyped_storage().data_ptr()] = Placed(params, starts, self.dp)

    def _gather(self, params):
        """Every one of ``params`` gathered on return (one new all-gather for those not under way)."""
        self._start(params)
        for p in params:
            if p.ds_inflight is not None:
                self._finish(p.ds_inflight)

    def _materialize(self, params):
        self._gather(params)

    def _release(self, params):
        """Drop the gathered data of those of ``params`` no one holds (not persistent, ``ds_rc`` 0). A storage
        none of whose parameters is held any more is freed; one whose other parameters are still held would
        stay alive for them: they move to a storage of their own (a copy of them) and it is freed."""
        touched = {}
        for p in params:
            if p.ds_persistent or p.ds_rc > 0 or p.data.numel() == 0:
                continue
            key = p.data.untyped_storage().data_ptr()
            p.data = torch.empty(0, dtype=self.dtype, device=self.device)
            placed = self._storage.get(key)
            if placed is not None:
                placed.drop(p)
                touched[key] = placed
        for key, placed in touched.items():
            if placed.any_held():
                self._move_out(placed.still_held())
            self._storage.pop(key, None)

    def _move_out(self, params):
        """``params`` (gathered) copied into a storage of their own, laid out as a flight of them."""
        buffer, starts = lay_out(params, self.dp, self.dtype, self.device)
        for p, start in zip(params, starts):
            buffer[start:start + p.ds_numel].copy_(p.data.reshape(-1))
        self._place(params, buffer, starts)

    def gather_unit(self, ui):
        ps = self.unit_params[ui]
        self._gather(ps)
        for p in ps:
            p.ds_rc += 1

    def release_unit(self, ui):
        for p in self.unit_params[ui]:
            p.ds_rc = max(0, p.ds_rc - 1)
        self._release(self.unit_params[ui])

    def _prefetch(self, ui, step):
        """Start gathering the unit after (step +1, forward) or before (-1, backward) ``ui`` in the
        last step's order. ``_fpos`` / ``_bpos`` follow the position in it (forward from the start,
        backward from the end), so a unit entered twice (the tied embedding: first and last)
        prefetches what follows that visit."""
        t = self._trace
        if not (self.prefetch and ui in t):
            return
        if step > 0:
            pos = self._fpos + 1 if self._fpos + 1 < len(t) and t[self._fpos + 1] == ui else t.index(ui)
            self._fpos = pos
        else:
            below = [j for j in range(min(self._bpos, len(t)) - 1, -1, -1) if t[j] == ui]
            pos = self._bpos = below[0] if below else t.index(ui)
        if 0 <= pos + step < len(t):
            self._start(self.unit_params[t[pos + step]])

    def _drain(self):
        """Wait for any gather still under way (unused prefetches) and drop what it brought."""
        for g in self.groups:
            for p in g:
                if p.ds_inflight is not None:
                    self._finish(p.ds_inflight)
                p.ds_rc = 0
        self._release([p for g in self.groups for p in g])

    def _refresh_persistent(self):
        """Re-gather the persistent (and any still gathered) parameters from the new shards."""
        held = [p for g in self.groups for p in g if p.data.numel()]
        persistent = [p for p in held if p.ds_persistent]
        for p in held:
            p.ds_rc, p.ds_persistent = 0, False
        self._release(held)
        for p in persistent:
            p.ds_persistent = True
        self._gather(persistent)

    # ---- saved-tensor hooks: parameters saved for backward are kept as references ----------
    def _pack(self, t):
        """A tensor in gathered storage -> the parameters it lies in (several for grouped GEMM's stacked view of
        the experts), its size, stride and offset from the first one's slot."""
        placed = self._storage.get(t.untyped_storage().data_ptr())
        slots = placed.locate(t) if placed is not None else None
        if not slots:
            return t
        first = slots[0][1]
        return (tuple(p for p, _ in slots), tuple(s - first for _, s in slots), t.size(), t.stride(),
                t.storage_offset() - first)

    def _unpack(self, packed):
        if isinstance(packed, torch.Tensor):
            return packed
        params, rels, size, stride, offset = packed
        missing = [p for p in params if p.data.numel() == 0]
        if missing:
            missing[0].ds_owner._materialize(missing)  # the stage that partitions them (over its own group)
        if len(params) == 1:
            p = params[0]
            return p.data.as_strided(size, stride, p.data.storage_offset() + offset)
        return rebuild(params, rels, size, stride, offset)

    @contextmanager
    def gathered_params(self, params):
        """`params` (of this stage) gathered for the duration, in one all-gather (a collective over its group)."""
        self._gather(params)
        for p in params:
            p.ds_rc += 1
        try:
            yield
        finally:
            for p in params:
                p.ds_rc -= 1
            self._release(params)

    @contextmanager
    def gathered(self):
        """Every parameter gathered for the duration (to save or inspect the full model)."""
        for ps in self.unit_params + [[p for g in self.groups for p in g]]:
            self._gather(ps)  # unit by unit: one all-gather each, no whole-model flat buffer
        for g in self.groups:
            for p in g:
                p.ds_rc += 1
        try:
            yield
        finally:
            for g in self.groups:
                for p in g:
                    p.ds_rc -= 1
            self._release([p for g in self.groups for p in g])

    def gathered_numel(self):
        return sum(p.data.numel() for g in self.groups for p in g)
