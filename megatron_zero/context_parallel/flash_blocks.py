"""One block of ring attention by torch's flash kernels, which return the log-sum-exp: the [q, k] scores of
a block exist only as the kernel's tiles, never as a tensor.

    CPU   aten._scaled_dot_product_flash_attention_for_cpu (+ _backward): fp32, bf16, any head dim
    CUDA  aten._scaled_dot_product_flash_attention (+ _backward): fp16 / bf16, head dim a multiple of 8
          up to 256, compute capability 8.0 or newer

A block is either causal within itself (a ring's first step: the rank's own queries and keys, whose
positions both ascend in the local order, so "key position <= query position" is "key index <= query
index") or wholly visible (every later step, by the load-balanced chunks); both are the kernels' own
`is_causal` cases, so no mask is built. The forward returns the block's output and log-sum-exp, which
merge exactly as block_attention.merge does; the backward of a block is the kernel's backward given the
MERGED output and the FINAL log-sum-exp (FlashAttention's recomputation: P = exp(q k^T scale - lse) is the
block's share of the global softmax, and rowsum(dout * out) the global delta), as ring-flash-attention
and Megatron-Core's TE context parallelism do. Attention dropout is not run here: the block path
(block_attention.py) keeps its hashed masks, which do not depend on how the keys are cut.

Where the op is missing from the installed torch (`flash_unavailable` says why), context parallelism
runs the block path instead (context_parallel/attention.py).
"""
from __future__ import annotations

from typing import Optional

import torch

CPU_OP, CUDA_OP = "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention"
CPU_DTYPES = (torch.float32, torch.bfloat16)
CUDA_DTYPES = (torch.float16, torch.bfloat16)


def _op(name: str):
    return getattr(torch.ops.aten, name, None)  # None where this torch lacks the op


def flash_unavailable(q: torch.Tensor) -> Optional[str]:
    """None where the flash kernel serves q [b, heads, s, d] on its device; else why not (one phrase)."""
    d, dtype = q.shape[-1], q.dtype
    if q.device.type == "cpu":
        if _op(CPU_OP) is None or _op(CPU_OP + "_backward") is None:
            return f"torch {torch.__version__} has no aten.{CPU_OP}"
        return None if dtype in CPU_DTYPES else f"the CPU flash kernel is not used for {dtype}"
    if q.device.type == "cuda":
        if _op(CUDA_OP) is None or _op(CUDA_OP + "_backward") is None:
            return f"torch {torch.__version__} has no aten.{CUDA_OP}"
        if dtype not in CUDA_DTYPES:
            return f"the CUDA flash kernel takes fp16 / bf16, not {dtype}"
        if d % 8 or d > 256:
            return f"the CUDA flash kernel takes head dims that are multiples of 8 up to 256, not {d}"
        if torch.cuda.get_device_capability(q.device) < (8, 0):
            return "the CUDA flash kernel needs compute capability 8.0 or newer"
        return None
    return f"no flash kernel on {q.device.type}"


def flash_forward(q, k, v, causal: bool, scale: float):
    """q [b, h, sq, d], k and v [b, h, sk, d] (heads expanded) -> (out [b, h, sq, d] fp32, lse [b, h, sq]
    fp32, what the backward of this block needs besides the tensors)."""
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    if q.device.type == "cpu":
        out, lse = _op(CPU_OP)(q, k, v, 0.0, causal, scale=scale)
        return out.float(), lse.float(), None
    out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = _op(CUDA_OP)(q, k, v, 0.0, causal, False, scale=scale)
    return out.float(), lse.float(), (cum_q, cum_k, max_q, max_k, seed, offset)


def flash_backward(dout, q, k, v, out, lse, causal: bool, scale: float, saved):
    """Gradients of one block given the merged output `out` (in q's dtype) and the final lse [b, h, sq]:
    -> dq [b, h, sq, d], dk and dv [b, h, sk, d] (q's dtype)."""
    dout, q, k, v, out, lse = (t.contiguous() for t in (dout.to(q.dtype), q, k, v, out, lse))
    if q.device.type == "cpu":
        return _op(CPU_OP + "_backward")(dout, q, k, v, out, lse, 0.0, causal, scale=scale)
    cum_q, cum_k, max_q, max_k, seed, offset = saved
    return _op(CUDA_OP + "_backward")(dout, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, 0.0, causal, seed,
                                      offset, scale=scale)
