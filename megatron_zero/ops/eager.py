"""What stays out of torch.compile's graphs inside a compiled layer (--compile-layers, compile/layers.py).

`eager(apply)` wraps an autograd.Function's apply in torch.compiler.disable: dynamo stops its graph there, the
function runs eagerly (forward and backward), and the compiled pieces resume after it. Two kinds use it:
- the fused kernels (megatron_zero/ops, model/block_causal_attention.py): C++/CUDA extensions inductor cannot
  trace;
- the model-parallel communication (tensor_parallel/conjugate.py's pairs, the asynchronous gradient
  all-reduce of tensor_parallel/linear_async.py): collectives that go through this package's shared-memory
  transport (distributed/shm_comm.py) or hold in-flight handles, which dynamo must not trace or reorder.
"""
import torch


def eager(apply):
    """`apply`, run eagerly when a compiled function calls it."""
    return torch.compiler.disable(apply)


def eager_apply(function_cls):
    """`function_cls.apply` (an autograd.Function's), run eagerly when a compiled function calls it; looked up at
    each call, so what replaces `apply` later (a test counting calls, a profiler hook) is what runs."""
    def apply(*args):
        return function_cls.apply(*args)
    return eager(apply)
