"""ZeRO-3 with --fp8-param-gather: the FP8 layers' weight shards cast to FP8 once per step, gathered in FP8.

torchao's FSDP2 float8 all-gather (`enable_fsdp_float8_all_gather`, `precompute_float8_dynamic_scale_for_fsdp`)
on stage3.py's per-layer gathers: after the optimizer step each rank casts its chunk of every FP8 layer's
fp32 master to FP8 (`p.ds_shard8`, 1 byte an element) with the whole weight's scale (fp8/param_gather.py:
one all-reduce MAX of the weights' amaxes over DP, then TP); every gather of a unit, in its forward and again
in its backward, then moves those bytes instead of the bf16 chunk. A unit's coalesced all-gather packs each
parameter's chunk as bytes (an FP8 weight's 1 an element, another's in the training dtype): every rank's
row is as long as every other's (each parameter is cut into dp equal chunks, partition.py), so it stays one
all_gather_into_tensor. Landing a gathered FP8 weight sets the layer's FP8 weight (the matmul multiplies
with it, fp8/matmul.py) and, as the parameter's data (its slot of the flight's storage, stage3_storage.py),
that weight dequantized in the training dtype (what autograd, the saved-tensor hooks and `gathered()` see:
the value the GEMMs use, never stale); releasing the parameter frees both. ZeRO-3 checkpoints hold the fp32 masters only, so nothing saved changes.
One copy at rest: an FP8 weight's chunk is held in FP8 only (`ds_shard8`); the other parameters' chunks in the
training dtype are views of a buffer of their own (`shards`), without the FP8 weights' bf16 chunks.
"""
from __future__ import annotations

import torch

from .stage3 import Stage3
from .stage3_gather import _Flight, _all_gather
from .stage3_storage import lay_out


class Stage3Float8(Stage3):
    def __init__(self, *args, fp8_gather, **kwargs):
        self.gather8 = fp8_gather  # before Stage3's init gathers the persistent parameters
        super().__init__(*args, **kwargs)
        for g in self.groups:
            for p in g:
                p.ds_layer = self.gather8.layer_of(p)
                if p.ds_layer is not None:
                    p.ds_shard8 = torch.zeros(p.ds_per, dtype=torch.uint8, device=self.device)
        self.fp8_params = [p for g in self.groups for p in g if p.ds_layer is not None]  # this rank's chunks
        for gi, g in enumerate(self.groups):  # the FP8 weights' chunks in FP8 only: the others' shards apart
            others = [p for p in g if p.ds_layer is None]
            shards, at = self.shards[gi].new_empty(sum(p.ds_per for p in others)), 0
            for p in others:
                shards[at:at + p.ds_per].copy_(p.ds_shard)
                p.ds_shard, at = shards[at:at + p.ds_per], at + p.ds_per
            for p in g:
                if p.ds_layer is not None:
                    p.ds_shard = None
            self.shards[gi] = shards
        self.fp8_index = self.gather8.fragment_index(p.ds_layer for p in self.fp8_params)
        for w8 in map(self.gather8.weight8, range(len(self.gather8.layers))):  # held only while gathered
            w8.data = w8.data.new_empty(0)

    def _nbytes(self, p) -> int:
        return p.ds_per * (1 if getattr(p, "ds_layer", None) is not None else self.dtype.itemsize)

    def _start(self, params):
        """One coalesced all-gather of the chunks' bytes (FP8 weights' 1 an element) of the params not yet
        gathered nor under way."""
        todo = [p for p in params if p.ds_inflight is None and p.data.numel() == 0]
        if not todo:
            return
        parts = [p.ds_shard8 if getattr(p, "ds_layer", None) is not None else p.ds_shard.view(torch.uint8)
                 for p in todo]
        flat = torch.cat(parts) if len(parts) > 1 else parts[0]
        work = None
        if self.dp > 1:
            out = torch.empty(flat.numel() * self.dp, dtype=torch.uint8, device=self.device)
            self.comm_bytes["all_gather"] += flat.numel() * (self.dp - 1)
            work = _all_gather(out, flat, group=self.dp_group, async_op=True)
        else:
            out = flat.clone()
        flight = _Flight(todo, out, work)
        for p in todo:
            p.ds_inflight = flight
        self.gather_calls += 1

    def _finish(self, flight):
        if flight.work is not None:
            flight.work.wait()
            flight.work = None
        rows, pos = flight.out.view(self.dp, -1), 0
        buffer, starts = lay_out(flight.params, self.dp, self.dtype, self.device)  # stage3_storage.py's slots
        for p, start in zip(flight.params, starts):
            n, slot = self._nbytes(p), buffer[start:start + p.ds_per * self.dp]
            if getattr(p, "ds_layer", None) is not None:  # (none before __init__ has set them)
                data = torch.empty(p.ds_per * self.dp, dtype=torch.uint8, device=self.device)
                data.view(self.dp, p.ds_per).copy_(rows[:, pos:pos + n])
                w8 = self.gather8.weight8(p.ds_layer)
                w8.data = data[:p.ds_numel].view(w8.data.dtype).view(p.ds_shape)
                slot[:p.ds_numel].copy_((w8.data.float() / w8.scale).reshape(-1))
            else:
                slot.view(torch.uint8).view(self.dp, n).copy_(rows[:, pos:pos + n])
            pos += n
            p.ds_inflight = None
        self._place(flight.params, buffer, starts)
        flight.out = flight.placed = None
        self.peak_param_numel = max(self.peak_param_numel, self.gathered_numel())

    def _release(self, params):
        super()._release(params)
        for p in params:
            if p.data.numel() == 0 and getattr(p, "ds_layer", None) is not None:
                w8 = self.gather8.weight8(p.ds_layer)
                w8.data = w8.data.new_empty(0)

    @torch.no_grad()
    def write_weights(self, masters, fp8: bool = True):
        """The updated masters into the shards, the FP8 weights' chunks cast from them, the persistent
        parameters gathered again. `fp8` False (ZeroOptimizer.state_dict's republication in the training
        dtype): nothing to do, a ZeRO-3 checkpoint holds the masters only."""
        if not fp8:
            return
        for g, m in zip(self.groups, masters):
            for p in g:
                if p.ds_layer is None:
                    p.ds_shard.copy_(m.detach()[p.ds_where[1]:p.ds_where[1] + p.ds_per])
        chunks = [masters[p.ds_where[0]][p.ds_where[1]:p.ds_where[1] + p.ds_per] for p in self.fp8_params]
        self.gather8.scales_from_fragments(chunks, self.fp8_index)
        for p, c in zip(self.fp8_params, chunks):
            p.ds_shard8.copy_(self.gather8.cast(p.ds_layer, c))
        self._refresh_persistent()

    def weight_slices(self):
        raise ValueError("with the FP8 weights gathered in FP8 an FP8 weight's chunk is held in FP8 only: publish "
                         "the fp32 masters (write_weights casts them)")

    def param_bytes(self):
        shards = sum(s.numel() * s.element_size() for s in self.shards)
        fp8 = sum(p.ds_shard8.numel() for p in self.fp8_params)
        return (shards + fp8 + self.gathered_numel() * self.dtype.itemsize
                + sum(self.gather8.weight8(i).data.numel() for i in range(len(self.gather8.layers))))

