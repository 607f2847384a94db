"""ZeRO stages 1 and 2 (and 0, plain data parallelism): partitioned fp32 masters and moments; full model weights on every rank.

Each param group's model weights become views of one flat buffer (model dtype), laid
out by ``partition.partition_group``; this rank's fp32 master is a copy of its partition.

Gradients go through grad_buckets.GradBuckets, one code path for every stage:

- Stages 0/1 (gradient-accumulation fusion on, the default): as Megatron's fp32 ``main_grad``,
  a post-accumulate-grad hook adds each micro-batch's gradient, as soon as backward produces it,
  into one persistent fp32 buffer per group and drops ``.grad``; this rank's fp32 gradient partition
  is its stretch of that buffer (no second tensor); at the step each bucket is reduce-scattered
  (stage 0: all-reduced) onto it, bucket by bucket (partition.strided_buckets): the bytes of one
  reduce-scatter of the gradient, never an all-reduce of it. --no-gradient-accumulation-fusion: ``.grad`` accumulates in the
  model dtype and is added into the buckets at the step.
- Stage 2: the hook adds each gradient into its bucket (consecutive parameters,
  partition.contiguous_buckets) and drops ``.grad``; a complete bucket is reduce-scattered and
  added into the partition, so no rank holds more gradient than the open buckets plus its partition.
- Parameters marked ``zero_defer_reduce`` (the pipeline-tied embedding, whose gradient is summed
  over the first and last stage after backward, pipeline/gpt_stage.py) accumulate into an fp32
  ``main_grad`` of their own (stage 2, or fusion on), which that sum reads; they go into their
  buckets at the step.
- ``grads_to_host`` (an offloaded optimizer, --cpu-optimizer): the fp32 gradient partitions live in host
  memory and each reduced bucket goes down as it lands (grad_buckets.py, host_grads.py).
- ``overlap_grad_reduce`` (stage12_overlap.py): buckets are launched async as they complete.
  ``grad_reduce_dtype`` bfloat16 (--grad-reduce-in-bf16): the collectives run in bf16, the sums
  stay fp32.

After the step, each rank writes its updated master into its slice of the flat buffer
(an offloaded optimizer uploads it there itself, ``weight_slices``) and the flat buffer is
all-gathered in place (``all_gather_into_tensor``, the slice being its input). With ``fp8_gather``
(--fp8-param-gather, fp8/param_gather.py) each rank sends a packed row instead, the FP8 layers' weights
cast from the masters to FP8, 1 byte an element (packed_gather.py), and no flat buffer of the whole group is
held: the other weights are views of a buffer of their own, the FP8 layers' weights in the training dtype
are not held between publications (their FP8 weight is the one copy); ``write_weights(..., fp8=False)``
publishes every weight in the training dtype again (a checkpoint's weights), through a flat buffer of the
group held for that gather only.
"""
from __future__ import annotations

from typing import List, Sequence, Tuple

import torch
import torch.distributed as dist

from ..distributed import shm_comm
from ..ops.fusion_flags import get_fusion_flags
from .grad_buckets import GradBuckets
from .packed_gather import PackedGather, all_gather_rows, hold_apart
from .partition import GroupPartition, contiguous_buckets, partition_group, strided_buckets


class Stage12:
    def __init__(self, groups: Sequence[Sequence[Tuple[str, torch.nn.Parameter]]], dp_group, stage: int,
                 dtype: torch.dtype, bucket_size: int, device: torch.device, overlap_grad_reduce: bool = False,
                 grad_reduce_dtype: torch.dtype = torch.float32, fp8_gather=None, grads_to_host: bool = False):
        self.stage, self.dtype, self.dp_group, self.device = stage, dtype, dp_group, device
        self.grads_on_host = grads_to_host  # an offloaded optimizer's: the fp32 partitions in host memory
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
            if fp8_gather is not None:  # the weights held apart (packed_gather.py): no flat buffer of the group
                flat = hold_apart(params, part, flat, fp8_gather)
            else:
                for p, off, n in zip(params, part.offsets, part.numels):
                    p.data = flat[off:off + n].view(p.shape)
            self.flat.append(flat)
        # --fp8-param-gather: the packed gather (FP8 weights as 1 byte an element)
        self.packed = (PackedGather(self.parts, self.groups, fp8_gather, self.rank, torch.finfo(dtype).bits // 8)
                       if fp8_gather is not None else None)
        self.overlap_grad_reduce = overlap_grad_reduce
        self.fused = get_fusion_flags().gradient_accumulation_fusion
        self._deferred = [(gi, pi) for gi, ps in enumerate(self.groups) for pi, p in enumerate(ps)
                          if getattr(p, "zero_defer_reduce", False)]
        if stage < 2:
            layouts = [strided_buckets(part, self.bucket_size) for part in self.parts]
        else:
            layouts = [contiguous_buckets(part, self.bucket_size, [pi for g, pi in self._deferred if g == gi])
                       for gi, part in enumerate(self.parts)]
        self.buckets = GradBuckets(self.parts, layouts, self.rank, dp_group, self.reduce_dp, device,
                                   persistent=stage < 2 and self.fused, async_op=overlap_grad_reduce,
                                   reduce_dtype=grad_reduce_dtype, to_host=grads_to_host)
        self.grad_parts = self.buckets.partitions
        self.main_grads = self.buckets.buffers if self.buckets.persistent else None
        # stage 0/1 with overlap reduce only in the global batch's last backward (arm())
        self.armed = stage == 2
        self._armed_params = set()
        self._hooks = []
        deferred = set(self._deferred)
        for gi, params in enumerate(self.groups):
            for pi, p in enumerate(params):
                if (gi, pi) in deferred:
                    if stage == 2 or self.fused:
                        p.main_grad = torch.zeros(p.shape, dtype=torch.float32, device=device)
                        self._hooks.append(p.register_post_accumulate_grad_hook(self._accumulate_main_grad))
                elif stage == 2 or self.fused or overlap_grad_reduce:
                    self._hooks.append(p.register_post_accumulate_grad_hook(
                        lambda p, key=(gi, pi): self._grad_ready(key, p)))

    # ---- what each rank owns -------------------------------------------------------
    def owned_ranges(self, gi: int):
        """(param, offset in param, offset in partition, numel) for this rank's partition."""
        return [(self.groups[gi][i], a, s, n) for i, a, s, n in self.parts[gi].param_ranges(self.rank)]

    def slice_mappings(self, names=None):
        return [part.fragments(self.rank) for part in self.parts]

    def group_paddings(self) -> List[int]:
        return [part.padding(self.rank) for part in self.parts]

    @property
    def peak_grad_numel(self) -> int:
        """The most gradient elements held at once outside the partitions (and the persistent buffers)."""
        return self.buckets.peak_numel

    # ---- during backward -------------------------------------------------------------
    @staticmethod
    def _accumulate_main_grad(p: torch.nn.Parameter):
        p.main_grad.add_(p.grad.detach())
        p.grad = None

    def _counting(self, key) -> bool:
        """Whether this gradient is the last one its buckets get before they are reduced."""
        return self.armed or (self.overlap_grad_reduce and id(self.groups[key[0]][key[1]]) in self._armed_params)

    def _grad_ready(self, key, p: torch.nn.Parameter):
        counting = self._counting(key)
        if self.stage == 2 or self.fused or counting:
            self.buckets.add(key, p.grad)
            p.grad = None
        if counting:
            self.buckets.ready(key)

    def finish_backward(self):
        """Called after each backward: stage 2 reduces its buckets left open (a parameter without a gradient)."""
        if self.stage == 2:
            deferred = set(self._deferred)
            self.buckets.launch_remaining(keep=lambda b: any(k in deferred for k in self.buckets.keys_of(b)))
            self.buckets.reset_counts()

    # ---- gradients for the step --------------------------------------------------------
    def grad_partitions(self) -> List[torch.Tensor]:
        """This rank's fp32 partition of each group's gradient, summed (not averaged) over DP."""
        self.buckets.land_all()
        deferred = set(self._deferred)
        for gi, params in enumerate(self.groups):  # same parameters, same order on every DP rank
            for pi, p in enumerate(params):
                key = (gi, pi)
                grad = getattr(p, "main_grad", None) if key in deferred else None
                grad = p.grad if grad is None else grad
                if grad is not None:  # the deferred ones; without fusion (stage 0/1) every one
                    self.buckets.add(key, grad)
                    p.grad = None
        self.buckets.launch_remaining()
        self.buckets.land_all()
        return self.grad_parts

    def zero_grad(self):
        for params in self.groups:
            for p in params:
                p.grad = None
                if getattr(p, "main_grad", None) is not None:
                    p.main_grad.zero_()
        self.buckets.zero()
        self.armed = self.stage == 2
        self._armed_params.clear()

    # ---- weights -------------------------------------------------------------------
    def weight_slices(self) -> List[torch.Tensor]:
        """Per group: this rank's slice of the flat buffer, where its updated weights go (an offloaded
        optimizer uploads them straight there). The packed gather holds no flat buffer: the FP8 weights are
        cast from the fp32 masters, wherever they live."""
        if self.packed is not None:
            raise ValueError("with the FP8 weights gathered in FP8 the weights are held apart, not in one flat "
                             "buffer: publish the fp32 masters (write_weights casts them)")
        return [flat[slice(*part.bounds(self.rank))] for flat, part in zip(self.flat, self.parts)]

    def write_weights(self, masters: List[torch.Tensor], fp8: bool = True):
        """Copy each updated master into this rank's slice (unless it is that slice already) and
        all-gather the flat buffers, the slice being the all-gather's input (in place); with the packed
        gather its packed rows instead, or (`fp8` False) every weight in the training dtype."""
        if self.packed is not None:
            if not fp8:
                return self._publish_unpacked(masters)
            for gi, gathered in enumerate(self._gather_packed(masters)):
                for pi in range(len(self.groups[gi])):
                    self.packed.land(gi, pi, gathered)
            return
        self._write_slices(masters)
        for flat, mine in zip(self.flat, self.weight_slices()):
            if self.dp > 1:
                shm_comm.all_gather_into_tensor(flat, mine, self.dp_group)

    def _write_slices(self, masters: List[torch.Tensor]) -> None:
        """Each updated master into this rank's slice of its flat buffer, unless it is that slice already."""
        for mine, m in zip(self.weight_slices(), masters):
            if m.data_ptr() != mine.data_ptr():
                mine.copy_(m.detach())  # a cast to the model dtype; masters held on the host come up

    @torch.no_grad()
    def _publish_unpacked(self, masters: List[torch.Tensor]) -> None:
        """The packed gather's weights, all in the training dtype from the masters (the FP8 layers' held again
        until the next FP8 publication): through a flat buffer of each group, all-gathered in place, then freed."""
        for gi, (params, part, m) in enumerate(zip(self.groups, self.parts, masters)):
            flat = torch.empty(part.padded_numel, dtype=self.dtype, device=self.device)
            mine = flat[slice(*part.bounds(self.rank))]
            mine.copy_(m.detach())
            if self.dp > 1:
                shm_comm.all_gather_into_tensor(flat, mine, self.dp_group)
            for p, off, n in zip(params, part.offsets, part.numels):
                if self.packed.gather8.layer_of(p) is not None:
                    p.data = flat[off:off + n].view(p.shape).clone()
                else:
                    p.data.copy_(flat[off:off + n].view(p.shape))

    def _gather_packed(self, masters: List[torch.Tensor]) -> List[torch.Tensor]:
        """Each group's packed rows, gathered (blocking): every rank's row, in rank order."""
        out = []
        for gi, row in enumerate(self.packed.pack(masters)):
            gathered = row.new_empty(self.packed.groups[gi].total_bytes)
            if self.dp > 1:
                all_gather_rows(self.packed.rows_of(gi, gathered), row, self.dp_group)
            else:
                gathered.copy_(row)
            out.append(gathered)
        return out

    def grad_bytes(self) -> int:
        held = sum(p.grad.numel() * p.grad.element_size() for ps in self.groups for p in ps if p.grad is not None)
        main = sum(p.main_grad.numel() * 4 for ps in self.groups for p in ps if getattr(p, "main_grad", None) is not None)
        return held + main + self.buckets.held_bytes()

    def host_grad_bytes(self) -> int:
        return self.buckets.host_bytes()

    def param_bytes(self) -> int:
        held = sum(f.numel() * f.element_size() for f in self.flat)
        if self.packed is None:
            return held
        return held + self.packed.gather8.held_bytes()  # the FP8 weights, and their layers' where held

    def remove_hooks(self):
        for h in self._hooks:
            h.remove()
        self._hooks = []
        for params in self.groups:  # the tied sum must not read a main_grad nobody fills any more
            for p in params:
                if hasattr(p, "main_grad"):
                    del p.main_grad
