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
(before a checkpoint is written or the weights are read). With --fp8-param-gather the packed rows
(packed_gather.py) are chunked the same way, in bytes, and the hook then lands the unit's parameters
out of them (an FP8 layer's weight into its FP8 tensor) before the unit runs.
"""
from __future__ import annotations

from typing import Dict, List, Set, Tuple

import torch
import torch.distributed as dist

from ..distributed.device import HOST
from .packed_gather import all_gather_rows
from .stage12 import Stage12
from .units import model_units


class Stage12Overlap(Stage12):
    def __init__(self, groups, dp_group, stage: int, dtype: torch.dtype, bucket_size: int,
                 overlap_grad_reduce: bool = True, overlap_param_gather: bool = False, module=None,
                 entry_points=("lm_logits", "lm_losses"), device: torch.device = HOST,
                 grad_reduce_dtype: torch.dtype = torch.float32, fp8_gather=None, grads_to_host: bool = False):
        super().__init__(groups, dp_group, stage, dtype, bucket_size, device, overlap_grad_reduce=overlap_grad_reduce,
                         grad_reduce_dtype=grad_reduce_dtype, fp8_gather=fp8_gather, grads_to_host=grads_to_host)
        self._gathers: Dict[Tuple[int, int], object] = {}
        self._packed_rows: Dict[int, Tuple[torch.Tensor, torch.Tensor]] = {}  # group -> (sent row, gathered rows)
        self._to_land: Set[Tuple[int, int]] = set()  # (group, param) not yet copied out of the gathered rows
        self.overlap_param_gather = overlap_param_gather and self.dp > 1
        if self.overlap_param_gather:
            if module is None:
                raise ValueError("overlap_param_gather needs module= (the model), to wait for each layer's "
                                 "parameters at its first use")
            self.chunk = max(1, -(-self.bucket_size // self.dp))
            if self.packed is not None:  # chunks of the packed rows, in bytes
                self.chunk *= torch.finfo(dtype).bits // 8
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
        if self.packed is not None:
            return {(gi, k) for _, a, b in self.packed.byte_range(gi, pi)
                    for k in range(a // self.chunk, (b - 1) // self.chunk + 1)}
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
            needs, keys = set(), [where[id(p)] for p in unit.parameters() if id(p) in where]
            for key in keys:
                needs |= self._chunks_of(*key)
            if not needs:
                continue
            self._hooks.append(unit.register_forward_pre_hook(lambda m, a, needs=needs, keys=keys:
                                                              self._wait(needs, keys)))
            for name in entry_points:  # methods that use a unit's weights outside its forward
                method = getattr(unit, name, None)
                if callable(method):
                    setattr(unit, name, self._waiting(needs, keys, method))

    def _waiting(self, needs, keys, method):
        def call(*args, **kwargs):
            self._wait(needs, keys)
            return method(*args, **kwargs)
        return call

    def _wait(self, needs, keys=()):
        """Wait for the gathers of `needs`; land the packed parameters `keys` out of them."""
        for key in needs:
            work = self._gathers.pop(key, None)
            if work is not None:
                work.wait()
        for key in keys:
            if key in self._to_land:
                self._to_land.discard(key)
                self.packed.land(*key, self._packed_rows[key[0]][1])

    def wait_params(self):
        self._wait(list(self._gathers), sorted(self._to_land))
        self._packed_rows.clear()

    def write_weights(self, masters: List[torch.Tensor], fp8: bool = True):
        """Write this rank's slice; start the all-gather of the rest chunk by chunk, async."""
        self.wait_params()
        if not self.overlap_param_gather or (self.packed is not None and not fp8):  # (a checkpoint's: blocking)
            return super().write_weights(masters, fp8)
        if self.packed is not None and fp8:
            return self._write_packed(masters)
        self._write_slices(masters)
        for gi, (flat, part) in enumerate(zip(self.flat, self.parts)):
            size = part.partition_size
            rows = flat.view(self.dp, size)
            mine = rows[self.rank]  # the gathers' input: kept until the next step (ZeroOptimizer.step waits first)
            for k, a in enumerate(range(0, size, self.chunk)):
                b = min(size, a + self.chunk)
                self._gathers[(gi, k)] = dist.all_gather([rows[r, a:b] for r in range(self.dp)], mine[a:b],
                                                         group=self.dp_group, async_op=True)

    def _write_packed(self, masters: List[torch.Tensor]):
        """The packed rows (packed_gather.py), all-gathered chunk by chunk, async; landed by the hooks."""
        for gi, row in enumerate(self.packed.pack(masters)):
            g = self.packed.groups[gi]
            gathered = row.new_empty(g.total_bytes)
            self._packed_rows[gi] = (row, gathered)  # the sent row too: kept until the gathers have landed
            for k, a in enumerate(range(0, max(g.row_bytes), self.chunk)):  # bytes [a, a + chunk) of every row
                self._gathers[(gi, k)] = all_gather_rows(self.packed.rows_of(gi, gathered, a, a + self.chunk),
                                                         row[a:a + self.chunk], self.dp_group, async_op=True)
            self._to_land.update((gi, pi) for pi in range(len(self.groups[gi])))
