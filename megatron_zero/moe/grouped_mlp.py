"""`--moe-grouped-gemm`: a rank's local experts as one grouped GEMM per MLP matmul (Megatron-Core's GroupedMLP).

The experts keep their own parameters (`deepspeed_experts.<id>.dense_h_to_4h.weight`, ...), so the
checkpoint layout (DeepSpeed-MoE's expert files, checkpoint/expert_layout.py), the ZeRO partitions and
resume are those of a run without the flag, and either run loads the other's checkpoints. The experts'
weights of one matmul enter as one [E, out, in] tensor (stacked_weights.py): under ZeRO 0-2 a view of
the flat buffer they already lie in, under ZeRO-3 a view of the storage their layer's gather filled, no
copy; without a ZeRO wrapper a stack, one copy per forward. Either way backward hands each expert its own
gradient. All rows, grouped by expert (offsets = cumulative row counts), go through

    fc1:  torch.nn.functional.grouped_mm(rows, W1^T, offs)   [rows, (2) ffn / tp]   column-parallel
    act:  GeLU (tanh) of fc1 + the row's expert's bias, or SwiGLU over [gate; up]
    fc2:  grouped_mm(act, W2^T, offs), summed over TP, + the expert's bias           row-parallel

The offsets and row counts reach the device from pinned memory without blocking (device.ints_to_device).
`grouped_mm` runs where torch has it (device.has_grouped_mm: CUDA, bf16, compute capability >= 8.0)
and both matmuls' inner strides are 16-byte multiples; elsewhere (the CPU, fp32) each expert's rows go
through F.linear in turn: the same sums, chosen from the device and dtype, never from a name. With FP8
(--fp8-format) each expert's rows go through that expert's own FP8 matmul in turn (fp8/experts.py).
Tensor parallelism is the dense MLP's: every TP rank sees the same rows, holds its slice of every expert.
"""
from __future__ import annotations

from itertools import accumulate
from typing import List, Sequence

import torch
import torch.nn.functional as F

from ..distributed.device import has_grouped_mm, ints_to_device
from .. import ops
from .stacked_weights import ALIGN_BYTES, stacked
from ..tensor_parallel import copy_to_tensor_model_parallel_region, reduce_from_tensor_model_parallel_region


def is_float8(layers: Sequence[torch.nn.Module]) -> bool:
    """Whether the experts' layers were converted to FP8 (fp8/convert.py)."""
    return getattr(layers[0], "fp8", None) is not None


def float8_experts_linear(x: torch.Tensor, layers: Sequence[torch.nn.Module], counts: Sequence[int]) -> torch.Tensor:
    """Rows of x grouped by expert (counts[e] rows of expert e) through expert e's FP8 matmul, x W_e^T."""
    chunks = torch.split(x, [int(n) for n in counts])
    return torch.cat([layer.fp8(chunk, layer.weight) for layer, chunk in zip(layers, chunks)])


def grouped_mm_fits(dtype: torch.dtype, *dims: int) -> bool:
    """Whether rows of `dims` elements of `dtype` keep grouped_mm's operands 16-byte aligned."""
    item = dtype.itemsize
    return all((d * item) % ALIGN_BYTES == 0 for d in dims)


def grouped_linear(x: torch.Tensor, weights: Sequence[torch.Tensor], counts: List[int], offs, grouped: bool):
    """Rows of x grouped by expert (counts[e] rows for expert e) times weights[e]^T ([out, in] each)."""
    if grouped:
        return F.grouped_mm(x, stacked(weights).transpose(1, 2), offs=offs)
    return torch.cat([F.linear(chunk, w) for chunk, w in zip(torch.split(x, counts), weights)])


def experts_linear(x: torch.Tensor, layers, counts: List[int], offs, grouped: bool):
    """grouped_linear with the experts' layers of one matmul: their FP8 matmuls where FP8 converted them."""
    if is_float8(layers):
        return float8_experts_linear(x, layers, counts)
    return grouped_linear(x, [m.weight for m in layers], counts, offs, grouped)


def rows_bias(biases: Sequence[torch.Tensor], expert_of_row: torch.Tensor) -> torch.Tensor:
    """Each row's expert's bias: [rows, out]."""
    return stacked(biases, aligned=False).index_select(0, expert_of_row)


class GroupedMLP:
    """The local experts' MLPs evaluated together; holds no parameters of its own (they stay the experts')."""

    def __init__(self, config, tp_group):
        self.tp_group, self.swiglu = tp_group, config.swiglu

    def uses_grouped_mm(self, experts, rows: torch.Tensor) -> bool:
        w1 = experts[0].dense_h_to_4h.weight
        return (rows.shape[0] > 0 and not is_float8([experts[0].dense_h_to_4h])
                and has_grouped_mm(rows.device, rows.dtype)
                and grouped_mm_fits(rows.dtype, w1.shape[1], w1.shape[0], experts[0].dense_4h_to_h.weight.shape[1]))

    def __call__(self, experts, rows: torch.Tensor, rows_per_expert: Sequence[int]) -> torch.Tensor:
        counts = [int(n) for n in rows_per_expert]
        grouped = self.uses_grouped_mm(experts, rows)
        offs = ints_to_device(list(accumulate(counts)), torch.int32, rows.device) if grouped else None
        fc1 = [e.dense_h_to_4h for e in experts]
        fc2 = [e.dense_4h_to_h for e in experts]
        expert_of_row = None
        if fc1[0].bias is not None or fc2[0].bias is not None:
            expert_of_row = torch.repeat_interleave(
                torch.arange(len(experts), device=rows.device),
                ints_to_device(counts, torch.int64, rows.device), output_size=rows.shape[0])
        x = copy_to_tensor_model_parallel_region(rows, self.tp_group)
        y = experts_linear(x, fc1, counts, offs, grouped)
        if fc1[0].bias is not None:
            y = y + rows_bias([m.bias for m in fc1], expert_of_row)
        y = ops.swiglu(y) if self.swiglu else F.gelu(y, approximate="tanh")
        out = experts_linear(y, fc2, counts, offs, grouped)
        out = reduce_from_tensor_model_parallel_region(out, self.tp_group)
        if fc2[0].bias is not None:
            out = out + rows_bias([m.bias for m in fc2], expert_of_row)
        return out
