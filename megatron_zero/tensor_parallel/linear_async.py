"""A column-parallel linear whose backward overlaps the input-gradient all-reduce with the weight gradient
(Megatron's LinearWithGradAccumulationAndAsyncCommunication, async all-reduce, no sequence parallelism).

Forward: y = x A^T + b on the replicated input (copy_to_tensor_model_parallel_region's identity).
Backward: grad_x = grad_y A is computed first and its all-reduce over TP started (shm_comm's
split-phase all-reduce: my part is published at once; or gloo's async op); then grad_A = grad_y^T x
and grad_b; then the all-reduce is waited for. The peers' lateness hides behind the weight-gradient
matmul instead of stalling it. Same values as copy_to + F.linear (the matmuls are autograd's).
"""
from __future__ import annotations

import torch

from ..distributed import shm_comm
from ..ops.eager import eager_apply


class _LinearAsyncGradAllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, group):
        ctx.save_for_backward(x, weight)
        ctx.group, ctx.has_bias = group, bias is not None
        return torch.nn.functional.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad_x = handle = None
        if ctx.needs_input_grad[0]:
            grad_x = grad.matmul(weight)
            handle = shm_comm.all_reduce_async(grad_x, ctx.group)
        grad_2d = grad.reshape(-1, grad.shape[-1])
        grad_w = grad_2d.t().mm(x.reshape(-1, x.shape[-1])) if ctx.needs_input_grad[1] else None
        grad_b = grad_2d.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        if handle is not None:
            handle.wait()
        return grad_x, grad_w, grad_b, None


_apply = eager_apply(_LinearAsyncGradAllReduce)  # an in-flight all-reduce: eager inside a compiled layer


def linear_with_async_grad_all_reduce(x, weight, bias, group):
    """F.linear(copy_to_tensor_model_parallel_region(x, group), weight, bias), its backward overlapped."""
    return _apply(x, weight, bias, group)
