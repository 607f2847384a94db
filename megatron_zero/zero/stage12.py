"""ZeRO stages 1 and 2 (and 0, plain data parallelism): partitioned fp32 masters and moments; full model weights on every rank.

Each param group's model weights become views of one flat buffer (model dtype), laid
out by ``partition.partition_group``; this rank's fp32 master is a copy of its partition.

Stage 1: after backward, every gradient is flattened and all-reduced; the rank keeps
its partition. Stage 2: a post-accumulate-grad hook collects gradients into buckets of
``bucket_size`` elements as backward produces them; a full bucket is reduce-scattered
(each rank receives the sum of the pieces in its partition) into a persistent fp32
partition-sized buffer and the parameters' ``.grad`` are dropped, so no rank ever holds
more gradient than one bucket plus its partition.

Stages 0 and 1 with gradient-accumulation fusion (on unless --no-gradient-accumulation-fusion):
as Megatron's fp32 ``main_grad``, each micro-batch's gradient is added, as soon as backward
produces it, into one persistent fp32 flat buffer per group and the parameter's ``.grad`` is
dropped, so accumulation over micro-batches is in fp32 (not bf16/fp16) and no model-dtype
gradient outlives its micro-batch. Off: ``.grad`` accumulates in the model dtype and is copied
into a fresh fp32 flat buffer at the step. In fp32 both give bit-identical sums.

After the step, each rank writes its updated master into its slice of the flat buffer
(an offloaded optimizer uploads it there itself, ``weight_slices``) and the slices are
all-gathered in place.
"""
from __future__ import annotations

from typing import List, Sequence, Tuple

import torch
import torch.distributed as dist

from .. import shm_comm
from ..ops.fusion_flags import get_fusion_flags
from ..reduce_scatter import reduce_scatter
from .partition import GroupPartition, partition_group


class Stage12:
    def __init__(self, groups: Sequence[Sequence[Tuple[str, torch.nn.Parameter]]], dp_group, stage: int,
                 dtype: torch.dtype, bucket_size: int, device: torch.device, accumulate_main_grads: bool = True):
        self.stage, self.dtype, self.dp_group, self.device = stage, dtype, dp_group, device
        # the DP size gradients are reduced over; stage 0 (plain data parallelism) keeps
        # everything whole, so it partitions over one rank
        self.reduce_dp = dist.get_world_size(dp_group) if dp_group is not None else 1
        self.dp = 1 if stage == 0 else self.reduce_dp
        self.rank = dist.get_rank(dp_group) if dp_group is not None and stage > 0 else 0
        self.bucket_size = int(bucket_size)
        self.groups = [[p for _, p in g] for g in groups]
        self.parts: List[GroupPartition] = [partition_group([(n, p.numel()) for n, p in g], self.dp)
                                            for g in groups]
        self.flat: List[torch.Tensor] = []
        self.initial_masters: List[torch.Tensor] = []
        for params, part in zip(self.groups, self.parts):
            flat32 = torch.zeros(part.padded_numel, dtype=torch.float32, device=device)
            for p, off, n in zip(params, part.offsets, part.numels):
                flat32[off:off + n].copy_(p.detach().reshape(-1))
            lo, hi = part.bounds(self.rank)
            self.initial_masters.append(flat32[lo:hi].clone())
            flat = flat32.to(dtype) if dtype != torch.float32 else flat32
            for p, off, n in zip(params, part.offsets, part.numels):
                p.data = flat[off:off + n].view(p.shape)
            self.flat.append(flat)
        self.grad_parts = [torch.zeros(p.partition_size, device=device) for p in self.parts] if stage == 2 else None
        self._hooks, self._bucket, self._bucket_numel = [], [], 0
        self.peak_grad_numel = 0
        # Parameters marked `zero_defer_reduce` (the pipeline-tied embedding, whose gradient is
        # summed over the first and last stage after backward) keep their .grad until the step.
        self._deferred = []
        self.main_grads = None
        if stage < 2 and accumulate_main_grads and get_fusion_flags().gradient_accumulation_fusion:
            self.main_grads = [torch.zeros(part.padded_numel, device=device) for part in self.parts]
            for gi, (params, part) in enumerate(zip(self.groups, self.parts)):
                for p, off, n in zip(params, part.offsets, part.numels):
                    if not getattr(p, "zero_defer_reduce", False):  # the tied embedding keeps .grad
                        self._hooks.append(p.register_post_accumulate_grad_hook(
                            lambda p, main=self.main_grads[gi][off:off + n]: self._accumulate(p, main)))
        if stage == 2:
            self._register_grad_hooks()

    def _register_grad_hooks(self):
        self._where = {}
        for gi, params in enumerate(self.groups):
            for pi, p in enumerate(params):
                self._where[id(p)] = (gi, pi)
                if getattr(p, "zero_defer_reduce", False):
                    self._deferred.append(p)
                else:
                    self._hooks.append(p.register_post_accumulate_grad_hook(self._grad_ready))

    # ---- what each rank owns -------------------------------------------------------
    def owned_ranges(self, gi: int):
        """(param, offset in param, offset in partition, numel) for this rank's partition."""
        return [(self.groups[gi][i], a, s, n) for i, a, s, n in self.parts[gi].param_ranges(self.rank)]

    def slice_mappings(self, names=None):
        return [part.fragments(self.rank) for part in self.parts]

    def group_paddings(self) -> List[int]:
        return [part.padding(self.rank) for part in self.parts]

    # ---- stages 0/1: fp32 accumulation during backward --------------------------------------
    def _accumulate(self, p: torch.nn.Parameter, main: torch.Tensor):
        main.add_(p.grad.detach().reshape(-1))
        p.grad = None

    # ---- stage 2: bucketed reduce-scatter during backward ---------------------------------
    def _grad_ready(self, p: torch.nn.Parameter):
        self._bucket.append(p)
        self._bucket_numel += p.numel()
        held = sum(q.grad.numel() for q in self._bucket if q.grad is not None)
        self.peak_grad_numel = max(self.peak_grad_numel, held)
        if self._bucket_numel >= self.bucket_size:
            self._flush()

    def _flush(self):
        if not self._bucket:
            return
        flat_in, mine = self._pack_bucket()
        out = torch.empty(flat_in[0].numel(), device=self.device)
        if self.dp > 1:
            reduce_scatter(out, flat_in, group=self.dp_group)
        else:
            out.copy_(flat_in[0])
        self._add_to_partitions(out, mine)

    def _pack_bucket(self):
        """Empty the bucket into dp equal fp32 rows (row r: the pieces in rank r's partition) and
        drop the gradients. -> (rows, [(group, offset in partition, numel)] of this rank's row)."""
        inputs = [[] for _ in range(self.dp)]
        mine = []  # (group, offset in partition, numel) in the order received
        for p in self._bucket:
            gi, pi = self._where[id(p)]
            part = self.parts[gi]
            off, n = part.offsets[pi], part.numels[pi]
            g = p.grad.detach().reshape(-1) if p.grad is not None else \
                torch.zeros(n, dtype=self.dtype, device=self.device)
            for r in range(self.dp):
                lo, hi = part.bounds(r)
                a, b = max(off, lo), min(off + n, hi)
                if a < b:
                    inputs[r].append(g[a - off:b - off].float())
                    if r == self.rank:
                        mine.append((gi, a - lo, b - a))
            p.grad = None
        sizes = [sum(t.numel() for t in ts) for ts in inputs]
        width = max(sizes)
        flat_in = []
        for ts, size in zip(inputs, sizes):
            t = torch.cat(ts) if ts else torch.zeros(0, device=self.device)
            flat_in.append(torch.cat([t, t.new_zeros(width - size)]) if size < width else t)
        self._bucket, self._bucket_numel = [], 0
        return flat_in, mine

    def _add_to_partitions(self, out: torch.Tensor, mine):
        pos = 0
        for gi, start, n in mine:
            self.grad_parts[gi].narrow(0, start, n).add_(out.narrow(0, pos, n))
            pos += n

    def finish_backward(self):
        """Called after each backward: reduce the last, partly filled bucket (stage 2)."""
        if self.stage == 2:
            self._flush()

    # ---- gradients for the step --------------------------------------------------------
    def grad_partitions(self) -> List[torch.Tensor]:
        """This rank's fp32 partition of each group's gradient, summed (not averaged) over DP."""
        if self.stage == 2:
            if self._deferred:  # same parameters, same order on every DP rank
                self._flush()
                self._bucket = list(self._deferred)
                self._flush()
            return self.grad_parts
        out = []
        for gi, (params, part) in enumerate(zip(self.groups, self.parts)):
            flat = self.main_grads[gi] if self.main_grads else torch.zeros(part.padded_numel, device=self.device)
            for p, off, n in zip(params, part.offsets, part.numels):
                if p.grad is not None:  # without fusion: every parameter; with it: the deferred ones
                    flat[off:off + n].copy_(p.grad.detach().reshape(-1))
            if self.reduce_dp > 1:
                shm_comm.all_reduce(flat, self.dp_group)
            self.peak_grad_numel = max(self.peak_grad_numel, part.padded_numel)
            lo, hi = part.bounds(self.rank)
            out.append(flat[lo:hi].clone())
        return out

    def zero_grad(self):
        for params in self.groups:
            for p in params:
                p.grad = None
        for g in (self.grad_parts or []) + (self.main_grads or []):
            g.zero_()
        self._bucket, self._bucket_numel = [], 0

    # ---- weights -------------------------------------------------------------------
    def weight_slices(self) -> List[torch.Tensor]:
        """Per group: this rank's slice of the flat buffer, where its updated weights go (an offloaded
        optimizer uploads them straight there)."""
        return [flat[slice(*part.bounds(self.rank))] for flat, part in zip(self.flat, self.parts)]

    def write_weights(self, masters: List[torch.Tensor]):
        """Copy each updated master into this rank's slice (unless it is that slice already) and
        all-gather the flat buffers, the slice being the all-gather's input (in place)."""
        for flat, mine, m in zip(self.flat, self.weight_slices(), masters):
            if m.data_ptr() != mine.data_ptr():
                mine.copy_(m.detach())  # a cast to the model dtype; masters held on the host come up
            if self.dp > 1:
                shm_comm.all_gather(list(flat.chunk(self.dp)), mine, self.dp_group)

    def grad_bytes(self) -> int:
        held = sum(p.grad.numel() * p.grad.element_size() for ps in self.groups for p in ps if p.grad is not None)
        return held + sum(g.numel() * 4 for g in (self.grad_parts or []) + (self.main_grads or []))

    def param_bytes(self) -> int:
        return sum(f.numel() * f.element_size() for f in self.flat)

    def remove_hooks(self):
        for h in self._hooks:
            h.remove()
        self._hooks = []
