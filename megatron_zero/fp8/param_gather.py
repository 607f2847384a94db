"""--fp8-param-gather: the FP8 layers' weights cast from the fp32 masters once per step and all-gathered in FP8.

Megatron-LM's flag (its distributed optimizer with Transformer Engine's FP8 parameters), and torchao's
`enable_fsdp_float8_all_gather` with `precompute_float8_dynamic_scale_for_fsdp` under FSDP2: after the
optimizer step each rank casts its shard of every FP8 layer's weight to FP8 and the ranks all-gather the
FP8 bytes (1 byte an element instead of bf16's 2). ZeRO owns the gather (megatron_zero/zero/packed_gather.py
at stages 1/2, stage3_fp8.py at stage 3: its partitions, packed rows, collectives); this module owns the FP8 side of it, for the layers the FP8
converter marked (`Float8Matmul.param_gather`):

- The scale of each weight, as the matmul would take it of the whole weight (matmul.py): tensorwise, from
  its amax over every element, so each rank's local amax (the max over its fp32 master fragments, 0 where it
  holds none) is all-reduced MAX over the data-parallel group (the shards) and then the tensor-parallel group
  (the matmul reduces a weight's amax over TP: a column- and a row-parallel weight are both split there);
  one all-reduce of all the weights' amaxes together, as torchao's precompute does. Delayed scaling: that
  amax is recorded into the weight's history first and the scale taken from the history after it (the
  weight's amax is known before its cast, unlike an activation's), so the history holds one weight amax a
  step, taken at the gather, instead of one a micro-batch taken by the forward.
- The cast: each fragment of a master (fp32), times the scale, to FP8 saturated (torchao's
  `to_fp8_saturated`): the same function the matmul applies to a weight, applied to the fp32 master
  instead of its bf16 copy.
- `Float8Weight`, the gathered weight: the matmul's forward and its backward's grad-input GEMM multiply
  with it (`Float8Matmul.weight8`); nothing casts the weight in the step.
- One copy (ZeRO-1/2; ZeRO-3 holds an FP8 weight's chunk in FP8 only, stage3_fp8.py): the weight of an FP8
  layer holds no bytes between a step's publication and a checkpoint's (`release`: a placeholder of its shape
  and dtype, one element of storage; autograd, the matmul and the gradient hooks read only its shape, dtype
  and device), as Megatron-LM's FP8 parameters are FP8 only. The readers of its values get them where they
  read: a checkpoint's ZeroOptimizer.state_dict publishes the weights from the masters in the training dtype
  first (the gather without FP8: the files are a bf16 run's, the weights held again until the next step),
  and they are held from the optimizer's making to its first step (a resume loads into them and may read
  them); the norms read the masters and gradients; an evaluation's forward multiplies by the FP8 weight.
- The experts' layers (fp8/experts.py) are gathered the same way, by a gather of their own over the
  expert-data-parallel group (their shards), their amaxes reduced over it and their expert-TP group.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import List, Optional, Sequence

import torch
import torch.distributed as dist
from torchao.float8.config import ScalingGranularity
from torchao.float8.float8_training_tensor import Float8TrainingTensor, GemmInputRole
from torchao.float8.float8_utils import amax_to_scale, to_fp8_saturated

REFUSED_RECIPES = ("rowwise", "rowwise_with_gw_hp")  # torchao's FP8 weight all-gather is tensorwise only


@dataclass
class Float8Weight:
    """A layer's weight [N, K] in FP8 and the scale it was cast with (0-d fp32)."""
    data: torch.Tensor
    scale: torch.Tensor

    def transposed(self, weight: torch.Tensor, mm_config) -> Float8TrainingTensor:
        """W^T as the matmul's cast of `weight.t()` would give it (tensorwise: one scale)."""
        return Float8TrainingTensor(self.data.t(), self.scale, weight.dtype, mm_config, GemmInputRole.WEIGHT, None)


def gathered_layers(model: torch.nn.Module, experts: Optional[bool] = None) -> List[torch.nn.Module]:
    """The FP8 layers whose weights ZeRO gathers in FP8, in module order (the same on every DP rank); `experts`
    True / False: only the MoE experts' / only the others (None: all)."""
    from .experts import is_expert

    return [m for m in model.modules() if getattr(getattr(m, "fp8", None), "param_gather", False)
            and (experts is None or is_expert(m) == experts)]


def placeholder(like: torch.Tensor) -> torch.Tensor:
    """A tensor of `like`'s shape, dtype and device over one element of storage (stride 0): what an FP8-gathered
    layer's weight holds between publications."""
    return torch.zeros((), dtype=like.dtype, device=like.device).expand(like.shape)


def holds_bytes(weight: torch.Tensor) -> bool:
    """Whether a weight holds its values (not a placeholder)."""
    return weight.numel() <= 1 or any(s != 0 for s in weight.stride())


class Float8ParamGather:
    """The FP8 side of ZeRO's gather for `layers` (gathered_layers) over `dp_group`."""

    def __init__(self, layers: Sequence[torch.nn.Module], dp_group, device: torch.device):
        self.layers = list(layers)
        self.index = {id(m.weight): i for i, m in enumerate(self.layers)}
        tp = {m.fp8.tp_group for m in self.layers}
        if len(tp) != 1:
            raise ValueError("the FP8 layers of one stage must share one tensor-parallel group")
        tp_group = tp.pop()
        # the amax all-reduce's groups: DP (the shards), then TP (the matmul reduces a weight's amax over TP)
        self.groups = [g for g in (dp_group, tp_group) if g is not None and dist.get_world_size(g) > 1]
        self.record = True
        self.device = device
        for m in self.layers:
            cast = m.fp8.config.cast_config_weight
            if (cast.scaling_granularity is not ScalingGranularity.TENSORWISE
                    or m.fp8.config.cast_config_weight_for_grad_input.scaling_granularity
                    is not ScalingGranularity.TENSORWISE):
                raise ValueError("--fp8-param-gather casts each weight with one scale (tensorwise or delayed "
                                 "scaling); rowwise scaling casts per row")
            m.fp8.weight8 = Float8Weight(torch.zeros(m.weight.shape, dtype=cast.target_dtype, device=device),
                                         torch.ones((), device=device))

    def weight8(self, layer: int) -> Float8Weight:
        """The layer's gathered FP8 weight (ZeRO-3 sets its data while the layer is gathered, frees it after)."""
        return self.layers[layer].fp8.weight8

    def layer_of(self, p: torch.nn.Parameter) -> Optional[int]:
        """The index of the FP8 layer whose weight `p` is, or None."""
        return self.index.get(id(p))

    @contextlib.contextmanager
    def without_recording(self):
        """Casts that record no amax (delayed scaling): republishing restored masters with restored scales."""
        self.record = False
        try:
            yield
        finally:
            self.record = True

    def fragment_index(self, layers: Sequence[int]) -> torch.Tensor:
        """The FP8 layer of each of a rank's master fragments, on the device: made once, so that
        `scales_from_fragments` copies nothing from the host in the step."""
        return torch.tensor(list(layers), dtype=torch.int64, device=self.device)

    @torch.no_grad()
    def scales_from_fragments(self, fragments: Sequence[torch.Tensor], index: torch.Tensor) -> None:
        """Every layer's scale from this rank's fp32 master fragments (fragments[i] a piece of layer index[i]'s
        weight): the max |element| per layer, 0 where the rank holds none of it, then set_scales."""
        amax = torch.zeros(len(self.layers), device=self.device)
        if fragments:  # (fp32 masters held on the host, --cpu-optimizer: one copy up)
            local = torch.stack([f.abs().max().float() for f in fragments]).to(self.device)
            amax.scatter_reduce_(0, index, local, "amax")
        self.set_scales(amax)

    @torch.no_grad()
    def set_scales(self, local_amax: torch.Tensor) -> None:
        """`local_amax`: per layer, the max |element| of this rank's master fragments of its weight (0: none);
        reduced in place to the whole weight's, then each layer's cast scale from it."""
        for g in self.groups:
            dist.all_reduce(local_amax, op=dist.ReduceOp.MAX, group=g)
        for amax, m in zip(local_amax, self.layers):
            mm, w8 = m.fp8, m.fp8.weight8
            dtype = mm.config.cast_config_weight.target_dtype
            if mm.delayed is not None:
                if self.record:
                    mm.delayed.record("w", amax, torch.finfo(dtype).max)
                w8.scale.copy_(mm.delayed.scale_for("w"))
            else:
                scale = amax_to_scale(amax, dtype, mm.config.round_scales_to_power_of_2)
                w8.scale.copy_(scale * 2.0 ** -mm.margin if mm.margin else scale)

    def cast(self, layer: int, master: torch.Tensor) -> torch.Tensor:
        """A fragment of the layer's fp32 master in FP8 with the layer's scale, as bytes (uint8) on the device (a
        master held on the host, --cpu-optimizer, goes up in fp32 and is cast there)."""
        w8 = self.layers[layer].fp8.weight8
        master = master.to(w8.scale.device, torch.float32)
        return to_fp8_saturated(master * w8.scale, w8.data.dtype).view(torch.uint8)

    def bytes_of(self, layer: int) -> torch.Tensor:
        """The layer's FP8 weight as flat bytes: where its gathered fragments land."""
        return self.layers[layer].fp8.weight8.data.view(torch.uint8).view(-1)

    def held_bytes(self) -> int:
        """The gathered FP8 weights' bytes (1 an element), and the layers' weights' in the training dtype where
        they are held (from a checkpoint's publication to the next step's)."""
        return sum(m.fp8.weight8.data.numel() + (m.weight.numel() * m.weight.element_size()
                                                  if holds_bytes(m.weight) else 0) for m in self.layers)

    def release(self) -> None:
        """Every layer's weight in the training dtype dropped: a placeholder (the FP8 weight is the one copy)."""
        for m in self.layers:
            if holds_bytes(m.weight):
                m.weight.data = placeholder(m.weight)
