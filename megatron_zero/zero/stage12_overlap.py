"""ZeRO stages 0-2 with communication overlapped: ``--overlap-grad-reduce``, ``--overlap-param-gather``.

Gradients (``overlap_grad_reduce``): Stage12's buckets (grad_buckets.GradBuckets) are launched
with ``async_op=True`` as soon as their last gradient is in, and backward goes on; at most
``MAX_IN_FLIGHT`` are under way, landed in launch order (same sums, same order as the blocking path).

- Stage 0/1 accumulate every micro-batch into the fp32 buffer; the buckets count their gradients
  down only once armed (``arm()``, which the schedule calls before the last micro-batch's backward;
  the interleaved schedule arms each model chunk's parameters, ``arm(params)``, before that chunk's
  last backward), so each bucket is reduced once per global batch, as soon as its last accumulation is done.
- Stage 2 reduces during every micro-batch's backward, as the blocking stage 2 does, now without waiting.
- Parameters marked ``zero_defer_reduce`` (the pipeline-tied embedding) go in at the step, after the
  tied sum, with every bucket not yet launched.

Parameters (``overlap_param_gather``, stage 1/2): after the step each group's updated
partition is all-gathered in chunks of about ``bucket_size / dp`` elements of every rank's
partition, async. A forward pre-hook on each unit (units.model_units: the model's children, containers
expanded, and the ``lm_logits`` and ``lm_losses`` entry points) waits only for the chunks its parameters lie in, so the
gathers finish behind the forward of the units before. ``wait_params()`` waits for all
(before a checkpoint is written or the weights are read).
"""
from __future__ import annotations

from typing import Dict, List, Set, Tuple

import torch
import torch.distributed as dist

from ..device import HOST
from .stage12 import Stage12
from .units import model_units


class Stage12Overlap(Stage12):
    def __init__(self, groups, dp_group, stage: int, dtype: torch.dtype, bucket_size: int,
                 overlap_grad_reduce: bool = True, overlap_param_gather: bool = False, module=None,
                 entry_points=("lm_logits", "lm_losses"), device: torch.device = HOST,
                 grad_reduce_dtype: torch.dtype = torch.float32):
        super().__init__(groups, dp_group, stage, dtype, bucket_size, device, overlap_grad_reduce=overlap_grad_reduce,
                         grad_reduce_dtype=grad_reduce_dtype)
        self._gathers: Dict[Tuple[int, int], object] = {}
        self.overlap_param_gather = overlap_param_gather and self.dp > 1
        if self.overlap_param_gather:
            if module is None:
                raise ValueError("overlap_param_gather needs module= (the model), to wait for each layer's "
                                 "parameters at its first use")
            self.chunk = max(1, -(-self.bucket_size // self.dp))
            self._gather_hooks(module, entry_points)

    # ---- gradients -----------------------------------------------------------------------
    @property
    def _in_flight(self):
        """The bucket collectives under way (what backward left running)."""
        return self.buckets._in_flight

    def arm(self, params=None):
        """The next backward is the global batch's last (for `params`; None: for all): count each of
        their gradients towards its bucket's launch when it is ready."""
        if not self.overlap_grad_reduce:
            return
        if params is None:
            self.armed = True
        else:
            self._armed_params.update(id(p) for p in params)

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
