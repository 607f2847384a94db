"""ZeRO stage 3's parameter gathering: coalesced all-gathers, release, prefetch, saved-tensor hooks.

A gather packs the rank's shards (``p.ds_shard``) of every not-yet-gathered parameter of a unit
into one flat buffer and issues a single all-gather of it (async when prefetching), as
DeepSpeed's ``all_gather_coalesced`` does. The result is rank-major ([dp, sum of chunks]);
finishing the gather copies each parameter's dp chunks into its own full tensor, so the
per-parameter layout (dp chunks of ceil(numel/dp), partition.py) is the same as gathering
each parameter on its own. A parameter whose gather is under way points at its ``_Flight``
(``p.ds_inflight``); waiting for any parameter of a flight finishes the whole flight.
Persistent parameters (outside every unit, or at most ``persistence_threshold`` elements)
stay gathered; they are re-gathered together, in one all-gather, after each optimizer step.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.distributed as dist

_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class _Flight:
    """One coalesced all-gather under way: its parameters, output buffer and work handle."""
    __slots__ = ("params", "out", "work")

    def __init__(self, params, out, work):
        self.params, self.out, self.work = params, out, work


class GatherMixin:
    """Needs: dtype, device, dp, dp_group, groups, unit_params, prefetch, _storage, _trace, _fpos, _bpos."""

    def _start(self, params):
        """Begin one all-gather of those of ``params`` that are neither gathered nor under way."""
        todo = [p for p in params if p.ds_inflight is None and p.data.numel() == 0]
        if not todo:
            return
        flat = torch.cat([p.ds_shard for p in todo]) if len(todo) > 1 else todo[0].ds_shard
        if self.dp > 1:
            out, work = self._all_gather_shards(flat)
        else:
            out, work = flat.clone() if len(todo) == 1 else flat, None
        flight = _Flight(todo, out, work)
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
        if len(flight.params) == 1:  # rank-major of one parameter is its own layout
            fulls = [flight.out]
        else:
            rows, pos, fulls = flight.out.view(self.dp, -1), 0, []
            for p in flight.params:
                full = torch.empty(p.ds_per * self.dp, dtype=self.dtype, device=self.device)
                full.view(self.dp, p.ds_per).copy_(rows[:, pos:pos + p.ds_per])
                pos += p.ds_per
                fulls.append(full)
        for p, full in zip(flight.params, fulls):
            p.ds_inflight = None
            p.data = full[:p.ds_numel].view(p.ds_shape)
            self._storage[full.untyped_storage().data_ptr()] = p
        flight.out = None
        self.peak_param_numel = max(self.peak_param_numel, self.gathered_numel())

    def _gather(self, params):
        """Every one of ``params`` gathered on return (one new all-gather for those not under way)."""
        self._start(params)
        for p in params:
            if p.ds_inflight is not None:
                self._finish(p.ds_inflight)

    def _materialize(self, p):
        self._gather([p])

    def _release(self, p):
        if p.ds_persistent or p.ds_rc > 0 or p.data.numel() == 0:
            return
        self._storage.pop(p.data.untyped_storage().data_ptr(), None)
        p.data = torch.empty(0, dtype=self.dtype, device=self.device)

    def gather_unit(self, ui):
        ps = self.unit_params[ui]
        self._gather(ps)
        for p in ps:
            p.ds_rc += 1

    def release_unit(self, ui):
        for p in self.unit_params[ui]:
            p.ds_rc = max(0, p.ds_rc - 1)
            self._release(p)

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
                self._release(p)

    def _refresh_persistent(self):
        """Re-gather the persistent (and any still gathered) parameters from the new shards."""
        held = [p for g in self.groups for p in g if p.data.numel()]
        for p in held:
            p.ds_rc, persistent = 0, p.ds_persistent
            p.ds_persistent = False
            self._release(p)
            p.ds_persistent = persistent
        self._gather([p for p in held if p.ds_persistent])

    # ---- saved-tensor hooks: parameters saved for backward are kept as references ----------
    def _pack(self, t):
        p = self._storage.get(t.untyped_storage().data_ptr())
        return (p, t.size(), t.stride(), t.storage_offset()) if p is not None else t

    def _unpack(self, packed):
        if isinstance(packed, torch.Tensor):
            return packed
        p, size, stride, offset = packed
        if p.data.numel() == 0:
            p.ds_owner._materialize(p)  # the stage that partitions it (over its own group)
        return p.data.as_strided(size, stride, offset)

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
                self._release(p)

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
                    self._release(p)

    def gathered_numel(self):
        return sum(p.data.numel() for g in self.groups for p in g)
