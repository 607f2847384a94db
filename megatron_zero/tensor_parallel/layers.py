"""Column-parallel linear, row-parallel linear and the vocab-parallel embedding.

Each layer holds only its TP rank's shard. The weights start at zero: the owner
(megatron_zero.model.init) fills them from layout-independent full tensors, so
the same seed gives the same full model whatever the TP size.

With tp_group=None each layer is the plain PyTorch layer (TP=1, no communication).

With `sequence_parallel` the activations outside the layers are split along the
sequence over the TP group: the column-parallel layer all-gathers its input (and
reduce-scatters the input gradient), the row-parallel layer reduce-scatters its
output instead of all-reducing it. A replicated parameter applied to a sequence
chunk (LayerNorm, the row-parallel bias) gets only this rank's part of its
gradient; `sequence_parallel_param` marks it (Megatron's `sequence_parallel`
attribute) and `sum_sequence_parallel_grad` sums that gradient over TP in backward.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .mappings import (copy_to_tensor_model_parallel_region, gather_from_sequence_parallel_region,
                       gather_from_tensor_model_parallel_region, reduce_from_tensor_model_parallel_region,
                       reduce_scatter_to_sequence_parallel_region, scatter_to_tensor_model_parallel_region)
from .linear_async import linear_with_async_grad_all_reduce
from .utils import divide, set_tensor_model_parallel_attributes, tp_rank_in, tp_world_size


def _param(*shape, dtype):
    return nn.Parameter(torch.zeros(*shape, dtype=dtype))


def sequence_parallel_param(param: nn.Parameter) -> nn.Parameter:
    param.sequence_parallel = True
    return param


def sum_sequence_parallel_grad(param: torch.Tensor, tp_group) -> torch.Tensor:
    """`param` as used in forward; with sequence parallelism its gradient is summed over TP."""
    if getattr(param, "sequence_parallel", False):
        return copy_to_tensor_model_parallel_region(param, tp_group)
    return param


class ColumnParallelLinear(nn.Module):
    """Y = XA + b with A split by columns: each rank computes output features [r*n/tp, (r+1)*n/tp).

    In PyTorch's [out, in] weight layout that is a dim-0 split of weight and bias.
    Returns (output, bias) when skip_bias_add (the bias is then left for a fused op).
    """

    def __init__(self, input_size, output_size, tp_group=None, bias=True, gather_output=False,
                 skip_bias_add=False, params_dtype=torch.float32, sequence_parallel=False):
        super().__init__()
        self.tp_group, self.gather_output, self.skip_bias_add = tp_group, gather_output, skip_bias_add
        self.sequence_parallel = sequence_parallel
        local = divide(output_size, tp_world_size(tp_group))
        self.weight = set_tensor_model_parallel_attributes(_param(local, input_size, dtype=params_dtype), True, 0)
        self.bias = set_tensor_model_parallel_attributes(_param(local, dtype=params_dtype), True, 0) if bias else None

    def forward(self, x):
        y = self._linear(x, None if self.skip_bias_add else self.bias)
        if self.gather_output:
            y = gather_from_tensor_model_parallel_region(y, self.tp_group)
        return (y, self.bias) if self.skip_bias_add else y

    def _linear(self, x, bias):
        """This rank's output features from the (sequence-parallel or replicated) input; a model transform
        may replace it (megatron_zero/fp8)."""
        if self.sequence_parallel:
            return F.linear(gather_from_sequence_parallel_region(x, self.tp_group), self.weight, bias)
        if tp_world_size(self.tp_group) > 1:
            return linear_with_async_grad_all_reduce(x, self.weight, bias, self.tp_group)
        return F.linear(x, self.weight, bias)


class RowParallelLinear(nn.Module):
    """Y = XA + b with A split by rows: each rank holds input features [r*n/tp, (r+1)*n/tp).

    In PyTorch's [out, in] layout that is a dim-1 split of the weight; the bias is
    replicated and added once, after the partial products are summed across TP.
    """

    def __init__(self, input_size, output_size, tp_group=None, bias=True, input_is_parallel=True,
                 skip_bias_add=False, params_dtype=torch.float32, sequence_parallel=False):
        super().__init__()
        self.tp_group, self.input_is_parallel, self.skip_bias_add = tp_group, input_is_parallel, skip_bias_add
        self.sequence_parallel = sequence_parallel and tp_world_size(tp_group) > 1
        if self.sequence_parallel and not input_is_parallel:
            raise ValueError("a sequence-parallel RowParallelLinear needs input_is_parallel=True (Megatron's rule)")
        local = divide(input_size, tp_world_size(tp_group))
        self.weight = set_tensor_model_parallel_attributes(_param(output_size, local, dtype=params_dtype), True, 1)
        self.bias = set_tensor_model_parallel_attributes(_param(output_size, dtype=params_dtype), False) if bias else None
        if self.bias is not None and self.sequence_parallel:
            sequence_parallel_param(self.bias)

    def forward(self, x):
        if not self.input_is_parallel:
            x = scatter_to_tensor_model_parallel_region(x, self.tp_group)
        if self.sequence_parallel:
            y = reduce_scatter_to_sequence_parallel_region(self._matmul(x), self.tp_group)
        else:
            y = reduce_from_tensor_model_parallel_region(self._matmul(x), self.tp_group)
        bias = None if self.bias is None else sum_sequence_parallel_grad(self.bias, self.tp_group)
        if self.skip_bias_add:
            return y, bias
        return y if bias is None else y + bias

    def _matmul(self, x):
        """This rank's partial product, before the sum over TP; a model transform may replace it."""
        return F.linear(x, self.weight)


class VocabParallelEmbedding(nn.Module):
    """Embedding whose rows (the vocabulary) are split across TP: rank r holds rows [r*V/tp, (r+1)*V/tp).

    A token outside a rank's range looks up zeros there; the all-reduce adds the
    one rank that holds it.
    """

    def __init__(self, num_embeddings, embedding_dim, tp_group=None, params_dtype=torch.float32):
        super().__init__()
        self.tp_group = tp_group
        local = divide(num_embeddings, tp_world_size(tp_group))
        self.vocab_start = tp_rank_in(tp_group) * local
        self.vocab_end = self.vocab_start + local
        self.weight = set_tensor_model_parallel_attributes(_param(local, embedding_dim, dtype=params_dtype), True, 0)

    def forward(self, tokens):
        if tp_world_size(self.tp_group) == 1:
            return F.embedding(tokens, self.weight)
        outside = (tokens < self.vocab_start) | (tokens >= self.vocab_end)
        local_tokens = (tokens - self.vocab_start).masked_fill(outside, 0)
        out = F.embedding(local_tokens, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tensor_model_parallel_region(out, self.tp_group)
