"""ZeRO stage 3: parameters partitioned too, gathered per layer around its forward and backward.

Each parameter is cut into dp chunks of ceil(numel/dp) (DeepSpeed's layout, see partition.py);
a rank keeps only its chunk (``p.ds_shard``, model dtype, a view of the group's flat shard buffer laid
out as the fp32 master) and ``p.data`` is empty between uses.
The model is split into *units* (units.model_units: its children, containers expanded): a forward
pre-hook all-gathers the unit's parameters, in one coalesced all-gather (stage3_gather.py), and
starts an async gather of the unit that came next in the last step's order (prefetch); a
forward hook releases them. The unit's outputs pass
through an identity autograd function whose backward re-gathers the unit (prefetching the unit
before it); a unit is released again once every parameter of it has its gradient. Parameter
tensors that autograd saves for backward are saved as references to the parameter (to each of
several, for a view over them: grouped GEMM's stacked experts) and rebuilt from the re-gathered data
(saved-tensor hooks), so they do not pin the gathered storage.
Gradients are reduce-scattered in buckets into this rank's fp32 chunk as they become ready (with
``grads_to_host``, an offloaded optimizer's, that chunk is in host memory: host_grads.py).
Methods named in ``entry_points`` (the tied embedding's ``lm_logits`` and ``lm_losses``) gather like a forward.
Parameters of at most ``persistence_threshold`` elements (DeepSpeed's
stage3_param_persistence_threshold, default 1e5; 0: none) and parameters outside every unit
are *persistent*: gathered once and kept, re-gathered (one all-gather) after each step.
Peak parameter memory: the rank's shard + the persistent parameters + the current unit + the
prefetched one.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..distributed.device import HOST
from ..distributed.reduce_scatter import reduce_scatter
from .host_grads import HostGradients
from .partition import zero3_group_offsets
from .stage3_gather import GatherMixin
from .units import model_units


class _PreBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, owner, unit, *tensors):
        ctx.owner, ctx.unit = owner, unit
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        ctx.owner._pre_backward(ctx.unit)
        return (None, None) + grads


class Stage3(GatherMixin):
    def __init__(self, groups, dp_group, dtype, bucket_size, module=None, layers=None, prefetch=True,
                 entry_points=("lm_logits", "lm_losses"), persistence_threshold=100_000, device=HOST, storage_map=None,
                 grads_to_host: bool = False):
        if module is None:
            raise ValueError("ZeRO stage 3 needs module= (the model), to gather each layer's parameters "
                             "around its forward and backward")
        self.dtype, self.dp_group, self.prefetch, self.device = dtype, dp_group, prefetch, device
        self.dp = self.reduce_dp = dist.get_world_size(dp_group) if dp_group is not None else 1
        self.rank = dist.get_rank(dp_group) if dp_group is not None else 0
        self.bucket_size = int(bucket_size)
        self.groups = [[p for _, p in g] for g in groups]
        self.offsets = [zero3_group_offsets([(n, p.numel()) for n, p in g], self.dp) for g in groups]
        # gathered storage -> its parameter (the saved-tensor hooks' map; shared by the two halves of
        # expert_stage3.py, whose hooks nest, so either half's hooks find the other's parameters)
        self._storage = storage_map if storage_map is not None else {}
        self.initial_masters, self.shards, sizes = [], [], []
        self.peak_param_numel = self.gather_calls = 0
        self.comm_bytes = {"all_gather": 0, "reduce_scatter": 0}  # sent by this rank
        for gi, (g, offs) in enumerate(zip(groups, self.offsets)):
            total = sum(per for _, per in offs.values())
            master = torch.zeros(total, device=device)
            shards = torch.empty(total, dtype=dtype, device=device)  # every p.ds_shard is a view of it
            for name, p in g:
                off, per = offs[name]
                padded = torch.zeros(per * self.dp, device=device)
                padded[:p.numel()].copy_(p.detach().reshape(-1))
                chunk = padded[self.rank * per:(self.rank + 1) * per]
                master[off:off + per].copy_(chunk)
                p.ds_numel, p.ds_shape, p.ds_per, p.ds_where = p.numel(), p.shape, per, (gi, off)
                p.ds_shard = shards[off:off + per]
                p.ds_shard.copy_(chunk)
                p.ds_rc, p.ds_inflight, p.ds_persistent, p.ds_owner = 0, None, False, self
                p.data = torch.empty(0, dtype=dtype, device=device)
            self.initial_masters.append(master)
            self.shards.append(shards)
            sizes.append(total)
        # an offloaded optimizer's: the fp32 gradient partitions in host memory, each reduced bucket brought
        # down as it is reduced (host_grads.py); the device holds only the bucket under way
        self.grads_on_host, self.host = grads_to_host, None
        if grads_to_host:
            self.host = HostGradients(sizes, device, min(self.bucket_size, sum(sizes)))
            self.grad_parts = self.host.partitions
        else:
            self.grad_parts = [torch.zeros(n, device=device) for n in sizes]
        managed = {id(p) for g in self.groups for p in g}
        self.units = list(layers) if layers is not None else model_units(module)
        in_unit = {id(p) for u in self.units for p in u.parameters()}
        self.persistence_threshold = int(persistence_threshold)
        self.persistent = [p for g in self.groups for p in g
                           if id(p) not in in_unit or p.ds_numel <= self.persistence_threshold]
        for p in self.persistent:  # small parameters and those outside every unit stay gathered
            p.ds_persistent = True
        self._gather(self.persistent)
        # a unit's parameters to gather: the non-persistent ones (a unit without any gets no hooks)
        self.unit_params = [[p for p in u.parameters() if id(p) in managed and not p.ds_persistent]
                            for u in self.units]
        self._hooks, self._saved_hooks = [], []
        for ui, u in enumerate(self.units):
            if not self.unit_params[ui]:
                continue
            self._hooks.append(u.register_forward_pre_hook(lambda m, a, ui=ui: self._pre_forward(ui)))
            self._hooks.append(u.register_forward_hook(lambda m, a, out, ui=ui: self._post_forward(ui, out)))
            for name in entry_points:  # methods that use a unit's weights outside its forward
                if callable(getattr(u, name, None)):
                    setattr(u, name, self._entry_point(ui, getattr(u, name)))
        self._units_of = {}
        for ui, ps in enumerate(self.unit_params):
            for p in ps:
                self._units_of.setdefault(id(p), []).append(ui)
        for g in self.groups:
            for p in g:
                self._hooks.append(p.register_post_accumulate_grad_hook(self._grad_ready))
        self._trace, self._order, self._pending, self._saved_hooks = [], [], {}, []
        self._fpos, self._bpos = -1, 1 << 62  # where forward / backward are in _trace
        self._bucket, self._bucket_numel, self.peak_grad_numel = [], 0, 0

    # ---- hooks -------------------------------------------------------------------------
    def _pre_forward(self, ui):
        self._order.append(ui)
        self.gather_unit(ui)
        self._prefetch(ui, +1)
        hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        hooks.__enter__()  # left in _post_forward: a forward hook pair cannot hold a `with` block
        self._saved_hooks.append(hooks)

    def _post_forward(self, ui, out):
        self._saved_hooks.pop().__exit__(None, None, None)
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
        """Reduce-scatter the bucket: row r of ``flat`` is what rank r receives the sum of, each
        gradient's chunk r written straight into it (its padding zeroed), fp32."""
        if not self._bucket:
            return
        flat = torch.empty(self.dp, sum(p.ds_per for p in self._bucket), device=self.device)
        pos = 0
        for p in self._bucket:
            per, n, dst = p.ds_per, p.ds_numel, flat[:, pos:pos + p.ds_per]
            pos += per
            if p.grad is None:
                dst.zero_()
                continue
            g, full = p.grad.detach().reshape(-1), n // per  # rows filled completely
            dst[:full].copy_(g[:full * per].view(full, per))
            if full < self.dp:
                dst[full, :n - full * per].copy_(g[full * per:])
                dst[full, n - full * per:].zero_()
                dst[full + 1:].zero_()
            p.grad = None
        out = self._reduce_scatter_rows(flat) if self.dp > 1 else flat[0]
        pieces, pos = [], 0
        for p in self._bucket:
            gi, off = p.ds_where
            pieces.append((self.grad_parts[gi][off:off + p.ds_per], pos, p.ds_per))
            pos += p.ds_per
        if self.host is not None:
            self.host.put(out, pieces)
        else:
            for target, a, n in pieces:
                target.add_(out[a:a + n])
        self._bucket, self._bucket_numel = [], 0

    def _reduce_scatter_rows(self, flat):
        """Sum over DP of row ``rank`` of every rank's ``flat`` [dp, n] (fp32)."""
        out = torch.empty(flat.size(1), device=self.device)
        self.comm_bytes["reduce_scatter"] += flat[0].numel() * 4 * (self.dp - 1)
        reduce_scatter(out, flat.unbind(0), group=self.dp_group)
        return out

    def finish_backward(self):
        self._flush()
        for ui in list(self._pending):
            self.release_unit(ui)
        self._pending = {}
        self._drain()  # drop prefetches that were not used and anything left gathered
        if self._order:
            self._trace, self._order = self._order, []
        self._fpos, self._bpos = -1, 1 << 62

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
        if self.host is not None:
            self.host.flush()
        return self.grad_parts

    def zero_grad(self):
        if self.host is not None:
            self.host.flush()
        for g in self.grad_parts:
            g.zero_()
        for ps in self.groups:
            for p in ps:
                p.grad = None

    def weight_slices(self):
        """Per group: the flat buffer of this rank's shards (the masters' layout, model dtype), where the
        updated weights go (an offloaded optimizer uploads them straight there)."""
        return self.shards

    def write_weights(self, masters):
        for shards, m in zip(self.shards, masters):
            if m.data_ptr() != shards.data_ptr():
                shards.copy_(m.detach())  # a cast to the model dtype; masters held on the host come up
        self._refresh_persistent()

    def slice_mappings(self, names):
        return [{n: (off, per) for n, (off, per) in offs.items()} for offs in self.offsets]

    def grad_bytes(self):
        held = sum(p.grad.numel() * p.grad.element_size() for g in self.groups for p in g if p.grad is not None)
        return held + (sum(g.numel() * 4 for g in self.grad_parts) if self.host is None else 0)

    def host_grad_bytes(self):
        return self.host.held_bytes() if self.host is not None else 0

    def param_bytes(self):
        shards = sum(p.ds_shard.numel() * p.ds_shard.element_size() for g in self.groups for p in g)
        return shards + self.gathered_numel() * self.dtype.itemsize

    def remove_hooks(self):
        for h in self._hooks:
            h.remove()
        self._hooks = []
