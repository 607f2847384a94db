"""ZeRO stage 3: parameters partitioned too, gathered per layer around its forward and backward.

Each parameter is cut into dp chunks of ceil(numel/dp) (DeepSpeed's layout, see partition.py);
a rank keeps only its chunk (``p.ds_shard``, model dtype) and ``p.data`` is empty between uses.
The model is split into *units* (its children, ModuleList/Sequential expanded): a forward
pre-hook all-gathers the unit's parameters (and starts an async gather of the unit that came
next in the last step's order: prefetch), a forward hook releases them. The unit's outputs pass
through an identity autograd function whose backward re-gathers the unit (prefetching the unit
before it); a unit is released again once every parameter of it has its gradient. Parameter
tensors that autograd saves for backward are saved as references to the parameter and rebuilt
from the re-gathered data (saved-tensor hooks), so they do not pin the gathered storage.
Gradients are reduce-scattered in buckets into this rank's fp32 chunk as they become ready.
Methods named in ``entry_points`` (the tied embedding's ``lm_logits``) gather like a forward.
Peak parameter memory: the rank's shard + the current unit + the prefetched one.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import List

import torch
import torch.distributed as dist

from .partition import zero3_group_offsets, zero3_param_partition


class _PreBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, owner, unit, *tensors):
        ctx.owner, ctx.unit = owner, unit
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        ctx.owner._pre_backward(ctx.unit)
        return (None, None) + grads


def _units(module: torch.nn.Module) -> List[torch.nn.Module]:
    out = []
    for child in module.children():
        if isinstance(child, (torch.nn.ModuleList, torch.nn.Sequential, torch.nn.ModuleDict)):
            out.extend(_units(child))
        else:
            out.append(child)
    return out


class Stage3:
    def __init__(self, groups, dp_group, dtype, bucket_size, module=None, layers=None, prefetch=True,
                 entry_points=("lm_logits",)):
        if module is None:
            raise ValueError("ZeRO stage 3 needs module= (the model), to gather each layer's parameters "
                             "around its forward and backward")
        self.dtype, self.dp_group, self.prefetch = dtype, dp_group, prefetch
        self.dp = self.reduce_dp = dist.get_world_size(dp_group) if dp_group is not None else 1
        self.rank = dist.get_rank(dp_group) if dp_group is not None else 0
        self.bucket_size = int(bucket_size)
        self.groups = [[p for _, p in g] for g in groups]
        self.offsets = [zero3_group_offsets([(n, p.numel()) for n, p in g], self.dp) for g in groups]
        self.initial_masters, self.grad_parts, self._storage = [], [], {}
        self.peak_param_numel = 0
        for gi, (g, offs) in enumerate(zip(groups, self.offsets)):
            total = sum(per for _, per in offs.values())
            master = torch.zeros(total)
            for name, p in g:
                off, per = offs[name]
                padded = torch.zeros(per * self.dp)
                padded[:p.numel()].copy_(p.detach().reshape(-1))
                chunk = padded[self.rank * per:(self.rank + 1) * per]
                master[off:off + per].copy_(chunk)
                p.ds_numel, p.ds_shape, p.ds_per, p.ds_where = p.numel(), p.shape, per, (gi, off)
                p.ds_shard = chunk.to(dtype).clone()
                p.ds_rc, p.ds_inflight, p.ds_persistent = 0, None, False
                p.data = torch.empty(0, dtype=dtype)
            self.initial_masters.append(master)
            self.grad_parts.append(torch.zeros(total))
        managed = {id(p) for g in self.groups for p in g}
        self.units = list(layers) if layers is not None else _units(module)
        self.unit_params = [[p for p in u.parameters() if id(p) in managed] for u in self.units]
        in_unit = {id(p) for ps in self.unit_params for p in ps}
        self.persistent = [p for g in self.groups for p in g if id(p) not in in_unit]
        for p in self.persistent:  # parameters outside every unit stay gathered
            p.ds_persistent = True
            self._materialize(p)
        self._hooks = []
        for ui, u in enumerate(self.units):
            self._hooks.append(u.register_forward_pre_hook(lambda m, a, ui=ui: self._pre_forward(ui)))
            self._hooks.append(u.register_forward_hook(lambda m, a, out, ui=ui: self._post_forward(ui, out)))
        for ui, u in enumerate(self.units):  # methods that use a unit's weights outside its forward
            for name in entry_points:
                if callable(getattr(u, name, None)):
                    setattr(u, name, self._entry_point(ui, getattr(u, name)))
        self._units_of = {}
        for ui, ps in enumerate(self.unit_params):
            for p in ps:
                self._units_of.setdefault(id(p), []).append(ui)
        for g in self.groups:
            for p in g:
                self._hooks.append(p.register_post_accumulate_grad_hook(self._grad_ready))
        self._trace, self._order, self._pending = [], [], {}
        self._bucket, self._bucket_numel, self.peak_grad_numel = [], 0, 0

    # ---- gather / release ----------------------------------------------------------
    def _start(self, p):
        if p.ds_inflight is None and p.data.numel() == 0:
            full = torch.empty(p.ds_per * self.dp, dtype=self.dtype)
            if self.dp > 1:
                work = dist.all_gather(list(full.chunk(self.dp)), p.ds_shard, group=self.dp_group, async_op=True)
            else:
                full.copy_(p.ds_shard)
                work = None
            p.ds_inflight = (full, work)

    def _materialize(self, p):
        self._start(p)
        if p.ds_inflight is not None:
            full, work = p.ds_inflight
            if work is not None:
                work.wait()
            p.ds_inflight = None
            p.data = full[:p.ds_numel].view(p.ds_shape)
            self._storage[full.untyped_storage().data_ptr()] = p
            self.peak_param_numel = max(self.peak_param_numel, self.gathered_numel())

    def _release(self, p):
        if p.ds_persistent or p.ds_rc > 0 or p.data.numel() == 0:
            return
        self._storage.pop(p.data.untyped_storage().data_ptr(), None)
        p.data = torch.empty(0, dtype=self.dtype)

    def gather_unit(self, ui):
        for p in self.unit_params[ui]:
            self._materialize(p)
            p.ds_rc += 1

    def release_unit(self, ui):
        for p in self.unit_params[ui]:
            p.ds_rc = max(0, p.ds_rc - 1)
            self._release(p)

    def _prefetch(self, ui, step):
        if self.prefetch and ui in self._trace:
            j = self._trace.index(ui) + step
            if 0 <= j < len(self._trace):
                for p in self.unit_params[self._trace[j]]:
                    self._start(p)

    # ---- hooks -------------------------------------------------------------------------
    def _pack(self, t):
        p = self._storage.get(t.untyped_storage().data_ptr())
        return (p, t.size(), t.stride(), t.storage_offset()) if p is not None else t

    def _unpack(self, packed):
        if isinstance(packed, torch.Tensor):
            return packed
        p, size, stride, offset = packed
        if p.data.numel() == 0:
            self._materialize(p)
        return p.data.as_strided(size, stride, offset)

    def _pre_forward(self, ui):
        self._order.append(ui)
        self.gather_unit(ui)
        self._prefetch(ui, +1)
        torch._C._autograd._push_saved_tensors_default_hooks(self._pack, self._unpack)

    def _post_forward(self, ui, out):
        torch._C._autograd._pop_saved_tensors_default_hooks()
        self.release_unit(ui)
        if not torch.is_grad_enabled():
            return out
        single = isinstance(out, torch.Tensor)
        items = [out] if single else list(out) if isinstance(out, (tuple, list)) else None
        if items is None:
            return out
        idx = [i for i, t in enumerate(items) if isinstance(t, torch.Tensor) and t.requires_grad]
        if not idx:
            return out
        wrapped = _PreBackward.apply(self, ui, *[items[i] for i in idx])
        for i, w in zip(idx, wrapped):
            items[i] = w
        return items[0] if single else type(out)(items)

    def _entry_point(self, ui, method):
        def gathered_call(*args, **kwargs):
            self._pre_forward(ui)
            return self._post_forward(ui, method(*args, **kwargs))
        return gathered_call

    def _pre_backward(self, ui):
        if ui in self._pending:  # a unit entered twice (tied embedding): already gathered
            return
        self.gather_unit(ui)
        self._pending[ui] = {id(p) for p in self.unit_params[ui]}
        self._prefetch(ui, -1)

    def _grad_ready(self, p):
        self._bucket.append(p)
        self._bucket_numel += p.ds_per * self.dp
        self.peak_grad_numel = max(self.peak_grad_numel, sum(q.grad.numel() for q in self._bucket
                                                             if q.grad is not None))
        if self._bucket_numel >= self.bucket_size:
            self._flush()
        for ui in self._units_of.get(id(p), []):
            pending = self._pending.get(ui)
            if pending is not None:
                pending.discard(id(p))
                if not pending:
                    del self._pending[ui]
                    self.release_unit(ui)

    def _flush(self):
        if not self._bucket:
            return
        inputs = [[] for _ in range(self.dp)]
        for p in self._bucket:
            g = torch.zeros(p.ds_per * self.dp)
            if p.grad is not None:
                g[:p.ds_numel].copy_(p.grad.detach().reshape(-1))
            for r, c in enumerate(g.chunk(self.dp)):
                inputs[r].append(c)
            p.grad = None
        flat_in = [torch.cat(ts) for ts in inputs]
        out = torch.empty_like(flat_in[0])
        if self.dp > 1:
            dist.reduce_scatter(out, flat_in, group=self.dp_group)
        else:
            out.copy_(flat_in[0])
        pos = 0
        for p in self._bucket:
            gi, off = p.ds_where
            self.grad_parts[gi][off:off + p.ds_per].add_(out[pos:pos + p.ds_per])
            pos += p.ds_per
        self._bucket, self._bucket_numel = [], 0

    def finish_backward(self):
        self._flush()
        for ui in list(self._pending):
            self.release_unit(ui)
        self._pending = {}
        for g in self.groups:  # drop prefetches that were not used and anything left gathered
            for p in g:
                if p.ds_inflight is not None:
                    self._materialize(p)
                p.ds_rc = 0
                self._release(p)
        if self._order:
            self._trace, self._order = self._order, []

    # ---- the optimizer's face ------------------------------------------------------------
    def owned_ranges(self, gi):
        """(param, offset in param, offset in flat group, numel) of this rank's real elements."""
        out = []
        for p in self.groups[gi]:
            _, off = p.ds_where
            lo = min(p.ds_numel, self.rank * p.ds_per)
            hi = min(p.ds_numel, lo + p.ds_per)
            if hi > lo:
                out.append((p, lo, off, hi - lo))
        return out

    def grad_partitions(self):
        return self.grad_parts

    def zero_grad(self):
        for g in self.grad_parts:
            g.zero_()
        for ps in self.groups:
            for p in ps:
                p.grad = None

    def write_weights(self, masters):
        for g, m in zip(self.groups, masters):
            for p in g:
                _, off = p.ds_where
                p.ds_shard.copy_(m.data[off:off + p.ds_per])
                if p.data.numel():  # a persistent (or still gathered) parameter: refresh it
                    p.ds_rc, persistent = 0, p.ds_persistent
                    p.ds_persistent = False
                    self._release(p)
                    p.ds_persistent = persistent
                    if persistent:
                        self._materialize(p)

    @contextmanager
    def gathered(self):
        """Every parameter gathered for the duration (to save or inspect the full model)."""
        for g in self.groups:
            for p in g:
                self._materialize(p)
                p.ds_rc += 1
        try:
            yield
        finally:
            for g in self.groups:
                for p in g:
                    p.ds_rc -= 1
                    self._release(p)

    def slice_mappings(self, names):
        return [{n: (off, per) for n, (off, per) in offs.items()} for offs in self.offsets]

    def gathered_numel(self):
        return sum(p.data.numel() for g in self.groups for p in g)

    def grad_bytes(self):
        held = sum(p.grad.numel() * p.grad.element_size() for g in self.groups for p in g if p.grad is not None)
        return held + sum(g.numel() * 4 for g in self.grad_parts)

    def param_bytes(self):
        shards = sum(p.ds_shard.numel() * p.ds_shard.element_size() for g in self.groups for p in g)
        return shards + self.gathered_numel() * torch.empty(0, dtype=self.dtype).element_size()

    def remove_hooks(self):
        for h in self._hooks:
            h.remove()
        self._hooks = []
