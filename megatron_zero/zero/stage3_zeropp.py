"""ZeRO++ on ZeRO-3: quantized weight gathers (qwZ), a secondary weight partition (hpZ) and
quantized gradient reduce-scatters (qgZ).

DeepSpeed config keys ``zero_quantized_weights``, ``zero_hpz_partition_size`` and
``zero_quantized_gradients`` (quantize.py has the wire format: int8 in blocks of 256, one fp32
scale per block).

- qwZ: each all-gather of a unit's shards sends the int8 shards and their scales (two async
  all-gathers); waiting for them dequantizes every rank's row, this rank's own included, so all
  ranks compute with the same weights. Only the gathered copies are quantized (the persistent
  parameters' too, and what ``gathered()`` shows): the shards, the fp32 masters the optimizer steps
  and the checkpoint (which ZeRO-3 writes from the masters) stay exact.
- hpZ (``hpz_group``, a block of h ranks of the DP group, topology.build_hpz_group): when a
  forward gather over DP finishes, each rank keeps its 1/h slice of every parameter it brought
  (``p.ds_secondary``, ceil(numel/h) elements); backward re-gathers a unit from those slices over
  the h ranks only, straight into the slots the DP gather lays out (stage3_storage.py), so the
  weights backward uses are bit-identical to forward's, in the same layout. Cost: the secondary
  slices of the units between their forward and their backward (numel/h each, instead of
  numel/dp); they are dropped after each step.
- qgZ: the bucket's [dp, n] fp32 rows (row r: what rank r receives the sum of) are quantized row
  by row and exchanged with one all-to-all (int8 and scales); each rank dequantizes the dp rows it
  received and sums them in rank order, in fp32. DeepSpeed's qgZ uses 4-bit, hierarchical
  all-to-alls; this is the int8, single-level form.

Bytes this rank sends are counted in ``comm_bytes`` (as the unquantized paths count theirs).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .quantize import dequantize, quantize, quantized_numel
from .stage3 import Stage3
from .stage3_gather import _all_gather, _Flight
from .stage3_storage import lay_out


class _QuantizedGather:
    """The two all-gathers (int8, scales) of one quantized flight; wait() dequantizes into ``out``."""

    def __init__(self, works, q, scales, out, dp):
        self.works, self.q, self.scales, self.out, self.dp = works, q, scales, out, dp

    def wait(self):
        for w in self.works:
            w.wait()
        rows = self.out.view(self.dp, -1)
        for row, q, s in zip(rows, self.q.view(self.dp, -1), self.scales.view(self.dp, -1)):
            row.copy_(dequantize(q, s, row.numel(), row.dtype))


class _HpzGather:
    """One all-gather over the hpZ group of secondary slices; wait() writes each parameter's h slices straight
    into its slot of the flight's storage (h ceil(numel/h) <= dp ceil(numel/dp) elements, h dividing dp)."""

    def __init__(self, work, gathered, params, buffer, starts, h):
        self.work, self.gathered, self.params, self.buffer, self.starts, self.h = work, gathered, params, buffer, starts, h

    def wait(self):
        self.work.wait()
        pieces, pos = self.gathered.view(self.h, -1), 0
        for p, start in zip(self.params, self.starts):
            s = p.ds_secondary.numel()
            self.buffer[start:start + self.h * s].view(self.h, s).copy_(pieces[:, pos:pos + s])
            pos += s


class Stage3ZeroPP(Stage3):
    def __init__(self, *args, quantized_weights: bool = False, quantized_gradients: bool = False,
                 hpz_group=None, **kwargs):
        self.quantized_weights, self.quantized_gradients = quantized_weights, quantized_gradients
        self.hpz_group = hpz_group
        self.h = dist.get_world_size(hpz_group) if hpz_group is not None else 1
        self._in_backward = False
        super().__init__(*args, **kwargs)
        self.comm_bytes["hpz_all_gather"] = 0
        if self.h > 1:
            j = dist.get_rank(hpz_group)
            for g in self.groups:
                for p in g:
                    p.ds_secondary, p.ds_hpz_slice = None, (j, -(-p.ds_numel // self.h))

    # ---- hpZ -----------------------------------------------------------------------------
    def _pre_forward(self, ui):
        self._in_backward = False
        super()._pre_forward(ui)

    def _pre_backward(self, ui):
        self._in_backward = True
        super()._pre_backward(ui)

    def finish_backward(self):
        self._in_backward = False
        super().finish_backward()

    def _start(self, params):
        todo = [p for p in params if p.ds_inflight is None and p.data.numel() == 0]
        if not (self.h > 1 and self._in_backward and todo and all(p.ds_secondary is not None for p in todo)):
            return super()._start(params)
        flat = torch.cat([p.ds_secondary for p in todo])
        gathered = torch.empty(flat.numel() * self.h, dtype=self.dtype, device=self.device)
        work = _all_gather(gathered, flat, group=self.hpz_group, async_op=True)
        self.comm_bytes["hpz_all_gather"] += flat.numel() * flat.element_size() * (self.h - 1)
        buffer, starts = lay_out(todo, self.dp, self.dtype, self.device)  # the DP gather's layout
        flight = _Flight(todo, None, _HpzGather(work, gathered, todo, buffer, starts, self.h), (buffer, starts))
        for p in todo:
            p.ds_inflight = flight
        self.gather_calls += 1

    def _finish(self, flight):
        over_dp = not isinstance(flight.work, _HpzGather)
        super()._finish(flight)
        if over_dp and self.h > 1:
            for p in (q for q in flight.params if not q.ds_persistent):
                j, s = p.ds_hpz_slice
                secondary = torch.zeros(s, dtype=self.dtype, device=self.device)
                piece = p.data.reshape(-1)[j * s:(j + 1) * s]
                secondary[:piece.numel()].copy_(piece)
                p.ds_secondary = secondary

    def write_weights(self, masters):
        if self.h > 1:
            for g in self.groups:
                for p in g:
                    p.ds_secondary = None
        super().write_weights(masters)

    def _all_gather_shards(self, flat):
        if not self.quantized_weights:
            return super()._all_gather_shards(flat)
        n = flat.numel()
        q, scales = quantize(flat)
        all_q = torch.empty(q.numel() * self.dp, dtype=torch.int8, device=self.device)
        all_s = torch.empty(scales.numel() * self.dp, device=self.device)
        works = [_all_gather(all_q, q, group=self.dp_group, async_op=True),
                 _all_gather(all_s, scales, group=self.dp_group, async_op=True)]
        self.comm_bytes["all_gather"] += (q.numel() + scales.numel() * 4) * (self.dp - 1)
        out = torch.empty(n * self.dp, dtype=self.dtype, device=self.device)
        return out, _QuantizedGather(works, all_q, all_s, out, self.dp)

    def _reduce_scatter_rows(self, flat):
        if not self.quantized_gradients:
            return super()._reduce_scatter_rows(flat)
        n = flat.size(1)
        qs = [quantize(row) for row in flat.unbind(0)]
        send_q = torch.cat([q for q, _ in qs])
        send_s = torch.cat([s for _, s in qs])
        recv_q, recv_s = torch.empty_like(send_q), torch.empty_like(send_s)
        dist.all_to_all_single(recv_q, send_q, group=self.dp_group)
        dist.all_to_all_single(recv_s, send_s, group=self.dp_group)
        self.comm_bytes["reduce_scatter"] += (quantized_numel(n) + send_s.numel() // self.dp * 4) * (self.dp - 1)
        out = torch.zeros(n, device=self.device)
        for q, s in zip(recv_q.view(self.dp, -1), recv_s.view(self.dp, -1)):
            out.add_(dequantize(q, s, n))
        return out

