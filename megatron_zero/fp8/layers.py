"""The tensor-parallel linear layers with their matmul in FP8 (the class the FP8 converter swaps in).

The communication around the matmul is the parent's: the column-parallel layer all-gathers its
sequence-parallel input or copies its replicated one into the TP region (an all-reduce of the input
gradient in backward; the FP8 path does not overlap it with the weight gradient as the bf16 path does),
the row-parallel layer sums or reduce-scatters its partial products. Only the matmul changes.
"""
from __future__ import annotations

from ..tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, sum_sequence_parallel_grad
from ..tensor_parallel.replicated_linear import ReplicatedLinear
from ..tensor_parallel.mappings import copy_to_tensor_model_parallel_region, gather_from_sequence_parallel_region
from ..tensor_parallel.utils import tp_world_size


class Float8ColumnParallelLinear(ColumnParallelLinear):
    fp8 = None  # a Float8Matmul, set by the converter

    def _linear(self, x, bias):
        if self.sequence_parallel:
            x = gather_from_sequence_parallel_region(x, self.tp_group)
        elif tp_world_size(self.tp_group) > 1:
            x = copy_to_tensor_model_parallel_region(x, self.tp_group)
        y = self.fp8(x, self.weight)
        return y if bias is None else y + bias.to(y.dtype)


class Float8RowParallelLinear(RowParallelLinear):
    fp8 = None

    def _matmul(self, x):
        return self.fp8(x, self.weight)


class Float8ReplicatedLinear(ReplicatedLinear):
    """MLA's down-projections: the whole weight on every rank, applied to its tokens (a sequence chunk with
    sequence parallelism, whose amaxes the converter reduces over that group)."""
    fp8 = None

    def _linear(self, x, bias):
        y = self.fp8(x, sum_sequence_parallel_grad(self.weight, self.sequence_parallel_group))
        return y if bias is None else y + sum_sequence_parallel_grad(bias, self.sequence_parallel_group).to(y.dtype)


FLOAT8_CLASS = {ColumnParallelLinear: Float8ColumnParallelLinear, RowParallelLinear: Float8RowParallelLinear,
                ReplicatedLinear: Float8ReplicatedLinear}
SPLIT = {ColumnParallelLinear: "column", RowParallelLinear: "row", ReplicatedLinear: "column"}
__all__ = ["FLOAT8_CLASS", "SPLIT", "Float8ColumnParallelLinear", "Float8RowParallelLinear", "Float8ReplicatedLinear"]
