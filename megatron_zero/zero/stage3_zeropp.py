"""ZeRO++ on ZeRO-3: quantized weight gathers (qwZ) and quantized gradient reduce-scatters (qgZ).

DeepSpeed config keys ``zero_quantized_weights`` and ``zero_quantized_gradients`` (quantize.py
has the wire format: int8 in blocks of 256, one fp32 scale per block).

- qwZ: each all-gather of a unit's shards sends the int8 shards and their scales (two async
  all-gathers); waiting for them dequantizes every rank's row, this rank's own included, so all
  ranks compute with the same weights. Only the gathered copies are quantized: the shards and the
  fp32 masters the optimizer steps stay exact.
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
from .stage3_gather import _all_gather


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


class Stage3ZeroPP(Stage3):
    def __init__(self, *args, quantized_weights: bool = False, quantized_gradients: bool = False, **kwargs):
        self.quantized_weights, self.quantized_gradients = quantized_weights, quantized_gradients
        super().__init__(*args, **kwargs)

    def _all_gather_shards(self, flat):
        if not self.quantized_weights:
            return super()._all_gather_shards(flat)
        n = flat.numel()
        q, scales = quantize(flat)
        all_q = torch.empty(q.numel() * self.dp, dtype=torch.int8)
        all_s = torch.empty(scales.numel() * self.dp)
        works = [_all_gather(all_q, q, group=self.dp_group, async_op=True),
                 _all_gather(all_s, scales, group=self.dp_group, async_op=True)]
        self.comm_bytes["all_gather"] += (q.numel() + scales.numel() * 4) * (self.dp - 1)
        out = torch.empty(n * self.dp, dtype=self.dtype)
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
        out = torch.zeros(n)
        for q, s in zip(recv_q.view(self.dp, -1), recv_s.view(self.dp, -1)):
            out.add_(dequantize(q, s, n))
        return out

