"""A linear layer whose weight every TP rank holds whole (Megatron-Core's 'duplicated' TELinear).

    down = ReplicatedLinear(h, rank, sequence_parallel_group=tp_group)   # or None without SP

Each rank applies the whole weight to its input. Where that input is the rank's sequence chunk
(sequence parallelism), the weight sees only the chunk's tokens, so its gradient is summed over
`sequence_parallel_group` in backward, as a sequence-parallel norm's is; otherwise every rank
computes the same gradient. A ColumnParallelLinear without a TP group, so the FP8 converter
swaps its matmul like the other linear layers'.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .layers import ColumnParallelLinear, sequence_parallel_param, sum_sequence_parallel_grad
from .utils import set_tensor_model_parallel_attributes


class ReplicatedLinear(ColumnParallelLinear):
    def __init__(self, input_size: int, output_size: int, sequence_parallel_group=None, bias: bool = False,
                 params_dtype=torch.float32):
        super().__init__(input_size, output_size, None, bias=bias, params_dtype=params_dtype)
        self.sequence_parallel_group = sequence_parallel_group
        for p in (self.weight, self.bias):
            if p is not None:
                set_tensor_model_parallel_attributes(p, False)
                if sequence_parallel_group is not None:
                    sequence_parallel_param(p)

    def _linear(self, x, bias):
        weight = sum_sequence_parallel_grad(self.weight, self.sequence_parallel_group)
        if bias is not None:
            bias = sum_sequence_parallel_grad(bias, self.sequence_parallel_group)
        return F.linear(x, weight, bias)
