"""Causal attention by query blocks that skip the keys they cannot see (the CPU's `fused` backend).

The queries are cut into blocks of `block` rows; block i (rows [iB, iB + B)) scores only keys
[0, iB + B), so the two GEMMs each way and the softmax touch (n + 1) / 2n of the s x s scores
for n blocks (5/8 at n = 4) instead of all of them. Each block's softmax is the fused causal
softmax with the diagonal shifted by iB (csrc/cpu_ops/causal_softmax.cpp). The probabilities are
kept for backward, as the unfused path keeps its s x s matrix (here (n + 1) / 2n of it), so this
suits short sequences; flash attention keeps O(s). No dropout: callers use it with p = 0 only.
"""
from __future__ import annotations

import torch

from ..ops.eager import eager_apply


class _BlockCausalAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, scale, block, ext):
        shape, s, d = q.shape, q.shape[-2], q.shape[-1]
        q3, k3, v3 = q.reshape(-1, s, d), k.reshape(-1, s, d), v.reshape(-1, s, v.shape[-1])
        out = q3.new_empty(v3.shape)  # v's head dimension may differ from q's and k's (MLA)
        probs = []
        for start in range(0, s, block):
            end = min(start + block, s)
            p = ext.causal_softmax_fwd(torch.bmm(q3[:, start:end], k3[:, :end].transpose(1, 2)), scale, start)
            out[:, start:end] = torch.bmm(p, v3[:, :end])
            probs.append(p)
        ctx.save_for_backward(q3, k3, v3, *probs)
        ctx.scale, ctx.block, ctx.ext, ctx.shape, ctx.v_shape = scale, block, ext, shape, v.shape
        return out.view(*shape[:-1], v.shape[-1])

    @staticmethod
    def backward(ctx, dout):
        q3, k3, v3, *probs = ctx.saved_tensors
        s = q3.shape[1]
        do = dout.reshape(v3.shape)
        dq, dk, dv = torch.empty_like(q3), torch.zeros_like(k3), torch.zeros_like(v3)
        for p, start in zip(probs, range(0, s, ctx.block)):
            end = min(start + ctx.block, s)
            do_i = do[:, start:end]
            dv[:, :end].baddbmm_(p.transpose(1, 2), do_i)
            ds = ctx.ext.causal_softmax_bwd(torch.bmm(do_i, v3[:, :end].transpose(1, 2)), p, ctx.scale, start)
            dq[:, start:end] = torch.bmm(ds, k3[:, :end])
            dk[:, :end].baddbmm_(ds.transpose(1, 2), q3[:, start:end])
        return dq.view(ctx.shape), dk.view(ctx.shape), dv.view(ctx.v_shape), None, None, None


_fused = eager_apply(_BlockCausalAttention)  # an extension: left to eager inside a compiled layer


def block_causal_attention(q, k, v, scale: float, block: int, ext) -> torch.Tensor:
    """softmax(q k^T * scale, causal) @ v for q, k [b, heads, s, head_dim] and v [b, heads, s, v_dim], through
    `ext`'s kernels."""
    return _fused(q, k, v, float(scale), int(block), ext)
