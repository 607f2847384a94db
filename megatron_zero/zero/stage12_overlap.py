"""ZeRO stages 0-2 with communication overlapped: ``--overlap-grad-reduce``, ``--overlap-param-gather``.

Gradients (``overlap_grad_reduce``): a post-accumulate-grad hook puts each gradient into a
bucket of ``bucket_size`` elements as backward produces it (Stage12's packing: dp fp32 rows,
row r the pieces in rank r's partition); a full bucket is reduce-scattered (stage 1/2) or
all-reduced (stage 0) with ``async_op=True`` and backward goes on. At most ``MAX_IN_FLIGHT``
buckets are under way: launching one more first waits for the oldest and adds it to this
rank's fp32 gradient partition, so results are added in launch order, as the blocking path
adds them (same sums, same order: bit-identical at DP 2, where a sum has one rounding).

- Stage 0/1 accumulate micro-batches in ``.grad``; the hooks act only once armed
  (``arm()``, which the schedule calls before the last micro-batch's backward; the interleaved
  schedule arms each model chunk's parameters, ``arm(params)``, before that chunk's last backward),
  so each gradient is reduced once per global batch, as soon as its last accumulation is done.
- Stage 2 drops gradients as it reduces them, so it reduces during every micro-batch's
  backward, as the blocking stage 2 does, now without waiting.
- Parameters marked ``zero_defer_reduce`` (the pipeline-tied embedding) are not hooked; they,
  and any gradient no armed hook took, are reduced at the step, after the tied sum.

Gradient memory: the ``.grad`` tensors not yet reduced + the partition + at most
``MAX_IN_FLIGHT`` buckets of fp32 rows and results.

Parameters (``overlap_param_gather``, stage 1/2): after the step each group's updated
partition is all-gathered in chunks of about ``bucket_size / dp`` elements of every rank's
partition, async. A forward pre-hook on each unit (units.model_units: the model's children, containers
expanded, and the ``lm_logits`` entry point) waits only for the chunks its parameters lie in, so the
gathers finish behind the forward of the units before. ``wait_params()`` waits for all
(before a checkpoint is written or the weights are read).
"""
from __future__ import annotations

from collections import deque
from typing import Dict, List, Set, Tuple

import torch
import torch.distributed as dist

from ..device import HOST
from ..reduce_scatter import reduce_scatter
from .stage12 import Stage12
from .units import model_units

MAX_IN_FLIGHT = 2


class Stage12Overlap(Stage12):
    def __init__(self, groups, dp_group, stage: int, dtype: torch.dtype, bucket_size: int,
                 overlap_grad_reduce: bool = True, overlap_param_gather: bool = False, module=None,
                 entry_points=("lm_logits",), device: torch.device = HOST):
        # stage 0/1 with overlapped reduction reduce .grad from their own hooks in the last backward,
        # so the fp32 main-grad accumulation of the base class (its hooks drop .grad) is not used
        super().__init__(groups, dp_group, stage, dtype, bucket_size, device,
                         accumulate_main_grads=not (overlap_grad_reduce and stage < 2))
        self.overlap_grad_reduce = overlap_grad_reduce
        self.armed = stage == 2
        self._armed_params: Set[int] = set()
        self._in_flight = deque()
        if overlap_grad_reduce and stage < 2:
            self.grad_parts = [torch.zeros(p.partition_size, device=self.device) for p in self.parts]
            self._register_grad_hooks()
        self._gathers: Dict[Tuple[int, int], object] = {}
        self.overlap_param_gather = overlap_param_gather and self.dp > 1
        if self.overlap_param_gather:
            if module is None:
                raise ValueError("overlap_param_gather needs module= (the model), to wait for each layer's "
                                 "parameters at its first use")
            self.chunk = max(1, -(-self.bucket_size // self.dp))
            self._gather_hooks(module, entry_points)

    # ---- gradients -----------------------------------------------------------------------
    def arm(self, params=None):
        """The next backward is the global batch's last (for `params`; None: for all): reduce each of
        their gradients when it is ready."""
        if params is None:
            self.armed = True
        else:
            self._armed_params.update(id(p) for p in params)

    def _grad_ready(self, p):
        if self.armed or id(p) in self._armed_params:
            super()._grad_ready(p)

    def _flush(self):
        if not self.overlap_grad_reduce:
            return super()._flush()
        if not self._bucket:
            return
        flat_in, mine = self._pack_bucket()
        if self.dp > 1:
            out = torch.empty(flat_in[0].numel(), device=self.device)
            work = reduce_scatter(out, flat_in, group=self.dp_group, async_op=True)
        else:
            out = flat_in[0]
            work = dist.all_reduce(out, group=self.dp_group, async_op=True) if self.reduce_dp > 1 else None
        self._in_flight.append((work, out, mine, flat_in))
        while len(self._in_flight) > MAX_IN_FLIGHT:
            self._land_oldest()

    def _land_oldest(self):
        work, out, mine, _ = self._in_flight.popleft()
        if work is not None:
            work.wait()
        self._add_to_partitions(out, mine)

    def finish_backward(self):
        if self.overlap_grad_reduce and self.armed:
            self._flush()
        elif not self.overlap_grad_reduce:
            super().finish_backward()

    def grad_partitions(self) -> List[torch.Tensor]:
        if not self.overlap_grad_reduce:
            return super().grad_partitions()
        self._flush()
        # the deferred (tied) parameters and whatever no armed hook reduced, in the same order on every rank
        deferred = {id(p) for p in self._deferred}
        self._bucket = [p for ps in self.groups for p in ps if id(p) in deferred or p.grad is not None]
        self._flush()
        while self._in_flight:
            self._land_oldest()
        return self.grad_parts

    def zero_grad(self):
        super().zero_grad()
        self.armed = self.stage == 2
        self._armed_params.clear()

    def grad_bytes(self) -> int:
        held = sum(sum(t.numel() * 4 for t in rows) + (out.numel() * 4 if self.dp > 1 else 0)
                   for _, out, _, rows in self._in_flight)
        return super().grad_bytes() + held

    # ---- parameters ----------------------------------------------------------------------
    def _chunks_of(self, gi: int, pi: int) -> Set[Tuple[int, int]]:
        """(group, chunk) pairs whose all-gather brings parameter pi of group gi."""
        part = self.parts[gi]
        off, n, size = part.offsets[pi], part.numels[pi], part.partition_size
        out = set()
        for r in range(self.dp):
            a, b = max(off, r * size), min(off + n, (r + 1) * size)
            if a < b:
                out.update((gi, k) for k in range((a - r * size) // self.chunk, (b - 1 - r * size) // self.chunk + 1))
        return out

    def _gather_hooks(self, module, entry_points):
        where = {id(p): (gi, pi) for gi, ps in enumerate(self.groups) for pi, p in enumerate(ps)}
        for unit in model_units(module):
            needs = set()
            for p in unit.parameters():
                if id(p) in where:
                    needs |= self._chunks_of(*where[id(p)])
            if not needs:
                continue
            self._hooks.append(unit.register_forward_pre_hook(lambda m, a, needs=needs: self._wait(needs)))
            for name in entry_points:  # methods that use a unit's weights outside its forward
                method = getattr(unit, name, None)
                if callable(method):
                    setattr(unit, name, self._waiting(needs, method))

    def _waiting(self, needs, method):
        def call(*args, **kwargs):
            self._wait(needs)
            return method(*args, **kwargs)
        return call

    def _wait(self, needs):
        for key in needs:
            work = self._gathers.pop(key, None)
            if work is not None:
                work.wait()

    def wait_params(self):
        self._wait(list(self._gathers))

    def write_weights(self, masters: List[torch.Tensor]):
        """Write this rank's slice; start the all-gather of the rest chunk by chunk, async."""
        self.wait_params()
        if not self.overlap_param_gather:
            return super().write_weights(masters)
        for gi, (flat, part, m) in enumerate(zip(self.flat, self.parts, masters)):
            size = part.partition_size
            rows = flat.view(self.dp, size)
            mine = rows[self.rank]  # the gathers' input: kept until the next step (ZeroOptimizer.step waits first)
            if m.data_ptr() != mine.data_ptr():
                mine.copy_(m.detach())
            for k, a in enumerate(range(0, size, self.chunk)):
                b = min(size, a + self.chunk)
                self._gathers[(gi, k)] = dist.all_gather([rows[r, a:b] for r in range(self.dp)], mine[a:b],
                                                         group=self.dp_group, async_op=True)
