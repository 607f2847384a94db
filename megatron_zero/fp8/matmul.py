"""The FP8 matmul of a tensor-parallel linear layer: torchao's float8 casts and GEMMs, scales over TP and CP.

y = x W^T with x [M, K] (M the tokens) and W [N, K], as torchao's `matmul_with_hp_or_float8_args`: the
forward casts x and W to FP8 and multiplies; the backward casts the output gradient g and again W and x
(each cast with its own scaling: `Float8LinearConfig`'s six cast configs) for grad_x = g W and
grad_W = g^T x. Each cast's scale is fp8_max / amax (torchao's `amax_to_scale`), divided by 2^margin.

The difference from torchao's module is where the amax is taken. One process computes it over the whole
tensor (tensorwise) or along one dimension (rowwise: per row of x, per output feature of W, ...). Here a
layer holds a shard: a column-parallel layer splits N over TP (its W and g are shards), a row-parallel layer
splits K (its x and W are shards), and context parallelism splits M (x and g hold this rank's tokens). An
amax whose reduction runs along a split dimension is all-reduced (MAX) over that dimension's group, as
torchao's DTensor path does for a sharded weight; the scales are then the one-process scales, and each rank
casts its shard exactly as one process would. Along a dimension that is not split no communication is
needed (a per-row amax over K of a column-parallel input is already whole).

An MoE expert's layers (fp8/experts.py) hold no CP-split tokens: their tokens are every row routed to
the expert, gathered by the expert-parallel exchange, and the group that splits them is the expert-data-
parallel one, which the converter passes as `cp_group` (the group splitting M). An expert no row was
routed to still casts (an empty tensor: amax 0) and takes part in each reduction; its GEMMs are skipped.

With delayed scaling (delayed.py) a cast multiplies by the scale its operand's amax history gives, and the
tensor's amax, reduced as above and over the data-parallel group as well, goes into that history.

With --fp8-param-gather (param_gather.py) ZeRO hands the layer its weight already in FP8 (`weight8`, cast
from the fp32 master with the whole weight's scale and all-gathered as FP8): the forward and the backward's
grad-input GEMM multiply with it, and the weight is not cast here.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from torchao.float8.config import ScalingGranularity, ScalingType
from torchao.float8.float8_training_tensor import (GemmInputRole, LinearMMConfig, ScaledMMConfig,
                                                   hp_tensor_and_scale_to_float8)
from torchao.float8.float8_utils import amax_to_scale, tensor_to_amax

from .delayed import AmaxHistory

# the dimension of each operand split over TP, in x [M, K], W^T [K, N], g [M, N] (None: whole)
TP_SPLIT = {"column": {"x": None, "w": 1, "g": 1}, "row": {"x": 1, "w": 0, "g": None}}
TOKENS = 0  # x and g hold this CP rank's tokens along dim 0


@dataclass
class Float8Matmul:
    """One layer's FP8 matmul: torchao's config, the layer's TP split and the groups the amaxes reduce over."""
    config: object  # torchao Float8LinearConfig
    split: str  # "column" or "row"
    tp_group: Optional[dist.ProcessGroup] = None
    cp_group: Optional[dist.ProcessGroup] = None  # the group splitting the tokens M (an expert's: expert-DP)
    margin: int = 0
    delayed: Optional[AmaxHistory] = None  # delayed scaling's state (delayed.py); None: the current amax
    dp_group: Optional[dist.ProcessGroup] = None  # delayed scaling reduces its amaxes over DP too
    param_gather: bool = False  # --fp8-param-gather: ZeRO gathers the weight in FP8 into `weight8`
    weight8: Optional[object] = None  # param_gather.Float8Weight: the weight in FP8, set by ZeRO's gather

    def __post_init__(self):
        c = self.config
        self.mm_config = LinearMMConfig(*(ScaledMMConfig(c.emulate, gemm.use_fast_accum, False, c.pad_inner_dim)
                                          for gemm in (c.gemm_config_output, c.gemm_config_grad_input,
                                                       c.gemm_config_grad_weight)))

    def __call__(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return _Float8Linear.apply(x, weight, self, torch.is_grad_enabled())

    def cast(self, t: torch.Tensor, cast_config, role, axis: Optional[int], operand: str,
             scale: Optional[torch.Tensor] = None, record: bool = True):
        """(`t` (2-D) in FP8, its scale): the scale of the whole tensor's amax (along `axis` for rowwise:
        axiswise), or under delayed scaling the history's (the amax then recorded, if `record`: not in a
        forward without autograd, an evaluation's); `scale` given: cast with it."""
        if cast_config.scaling_type is ScalingType.DISABLED:
            return t, None
        tensorwise = cast_config.scaling_granularity is ScalingGranularity.TENSORWISE
        axis = None if tensorwise else axis  # torchao's: 0 or -1
        if scale is None and self.delayed is not None:
            scale = self.delayed.scale_for(operand)
            if record:  # reduced with the others' when the next cast of this operand needs it (delayed.py)
                amax = _amax(t, ScalingGranularity.TENSORWISE, None)
                self.delayed.defer(operand, amax, torch.finfo(cast_config.target_dtype).max,
                                   self._groups(operand, True, None))
        elif scale is None:
            amax = _amax(t, cast_config.scaling_granularity, axis)
            self._reduce(amax, operand, tensorwise, axis)
            scale = amax_to_scale(amax, cast_config.target_dtype, self.config.round_scales_to_power_of_2)
            if self.margin:
                scale = scale * 2.0 ** -self.margin
        return hp_tensor_and_scale_to_float8(t, scale, cast_config.target_dtype, self.mm_config, role, axis), scale

    def _groups(self, operand: str, tensorwise: bool, axis: Optional[int]) -> tuple:
        """The groups whose ranks hold other parts of what the amax is taken over."""
        along = None if tensorwise else axis % 2
        tp_dim = TP_SPLIT[self.split][operand]
        groups = []
        if self.tp_group is not None and tp_dim is not None and (tensorwise or along == tp_dim):
            groups.append(self.tp_group)
        if self.cp_group is not None and operand != "w" and (tensorwise or along == TOKENS):
            groups.append(self.cp_group)
        if self.delayed is not None and self.dp_group is not None:
            groups.append(self.dp_group)
        return tuple(groups)

    def _reduce(self, amax: torch.Tensor, operand: str, tensorwise: bool, axis: Optional[int]) -> None:
        """MAX over the groups whose ranks hold other parts of what the amax is taken over."""
        for group in self._groups(operand, tensorwise, axis):
            dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)


def _amax(t: torch.Tensor, granularity, axis: Optional[int]) -> torch.Tensor:
    """torchao's tensor_to_amax; 0 where it would reduce over no elements (an expert no row was routed to)."""
    if t.numel() == 0:
        tensorwise = granularity is ScalingGranularity.TENSORWISE
        return t.new_zeros(() if tensorwise else [1 if d == axis % t.dim() else n for d, n in enumerate(t.shape)])
    return tensor_to_amax(t, scaling_granularity=granularity, axiswise_dim=axis)


def _mm(a, b) -> torch.Tensor:
    """a @ b of two FP8 operands; zeros without a GEMM where the inner or an outer size is 0 (no rows)."""
    if 0 in (a.shape[0], a.shape[1], b.shape[1]):
        return torch.zeros(a.shape[0], b.shape[1], dtype=a.dtype, device=a.device)
    return torch.mm(a, b)


class _Float8Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, mm: Float8Matmul, training: bool):
        ctx.save_for_backward(x, weight)
        ctx.mm = mm
        c = mm.config
        x2 = x.reshape(-1, x.shape[-1])
        x8, sx = mm.cast(x2, c.cast_config_input, GemmInputRole.INPUT, -1, "x", record=training)
        if mm.weight8 is not None:
            w8, sw = mm.weight8.transposed(weight, mm.mm_config), None
        else:
            w8, sw = mm.cast(weight.t(), c.cast_config_weight, GemmInputRole.WEIGHT, 0, "w", record=training)
        ctx.scales = (sx, sw) if mm.delayed is not None else (None, None)  # delayed: the backward recasts with them
        return _mm(x8, w8).reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        mm = ctx.mm
        c = mm.config
        sx, sw = ctx.scales
        g = grad.reshape(-1, grad.shape[-1])
        g8, sg = mm.cast(g, c.cast_config_grad_output, GemmInputRole.GRAD_OUTPUT, -1, "g")
        w8 = (mm.weight8.transposed(weight, mm.mm_config) if mm.weight8 is not None else
              mm.cast(weight.t(), c.cast_config_weight_for_grad_input, GemmInputRole.WEIGHT, -1, "w", sw)[0])
        grad_x = _mm(g8, w8.t()).reshape(*grad.shape[:-1], weight.shape[1])
        g8, _ = mm.cast(g, c.cast_config_grad_output_for_grad_weight, GemmInputRole.GRAD_OUTPUT, 0, "g",
                        sg if mm.delayed is not None else None)
        x8, _ = mm.cast(x.reshape(-1, x.shape[-1]), c.cast_config_input_for_grad_weight, GemmInputRole.INPUT, 0, "x",
                        sx)
        grad_w = _mm(g8.t(), x8)
        return grad_x, grad_w, None, None
