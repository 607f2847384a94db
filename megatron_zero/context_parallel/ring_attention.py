"""`--cp-comm-type p2p`: causal attention over a context-parallel sequence by a ring exchange of K/V.

CP ranks form a ring (rank r sends to r + 1, receives from r - 1). At step i a rank holds the K/V of
CP rank src = r - i and attends its queries to them while the next block travels (`batch_isend_irecv`
posted before the step's compute: communication overlaps it); partial results merge by online softmax
(block_attention.merge). With the load-balanced chunks (chunks.py) every step past the first is half a
block, as in Megatron's ring:

    step 0      my queries      x my K/V                 causal within the chunks
    src < r     my queries      x src's first chunk      all visible
    src > r     my second chunk x src's K/V              all visible

Backward runs the same ring again: K/V travel as in forward, and their gradient accumulator travels
with them one step behind (each rank adds its contribution to the block it holds and passes it on);
after CP hops every rank holds the full dK/dV of its own block. Only the K/V heads travel (GQA: the
groups, expanded to query heads locally), and the accumulator is fp32. Nothing s x s is saved: the
backward recomputes each block's probabilities from q, k, v, the output and its log-sum-exp.

Each block runs by one of two kernels (`flash`, chosen by attention.py): torch's flash kernel
(flash_blocks.py: no [q, k] tensor at all; step 0 is its causal case, every later step its unmasked one)
or block_attention's query pieces (scores of QUERY_ROWS queries at a time; attention dropout).
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from .block_attention import block_backward, block_forward, expand_heads, merge, sum_heads
from .chunks import cp_positions
from .flash_blocks import flash_backward, flash_forward

KV_TAG, GRAD_TAG = 0, 1


def _ring_exchange(send: torch.Tensor, recv: torch.Tensor, ranks, cp_rank: int, group, tag: int):
    """Post send -> next rank and recv <- previous rank; returns the requests to wait on."""
    cp = len(ranks)
    ops = [dist.P2POp(dist.isend, send, ranks[(cp_rank + 1) % cp], group, tag),
           dist.P2POp(dist.irecv, recv, ranks[(cp_rank - 1) % cp], group, tag)]
    return dist.batch_isend_irecv(ops)


def _wait(requests):
    for req in requests:
        req.wait()


def _step_blocks(step: int, src: int, cp_rank: int, chunk: int):
    """(query rows, key rows) of the local sequence that step `step` computes (see the module docstring)."""
    if step == 0:
        return slice(None), slice(None)
    if src < cp_rank:
        return slice(None), slice(0, chunk)
    return slice(chunk, None), slice(None)


class RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, seq_length: int, group, ranks, cp_rank: int, dropout=None, flash=False):
        cp, heads, groups = len(ranks), q.shape[1], k.shape[1]
        scale, chunk = 1.0 / math.sqrt(q.shape[-1]), q.shape[2] // 2
        positions = [cp_positions(seq_length, cp, j, q.device) for j in range(cp)]
        kv = torch.stack([k, v])
        out = lse = None
        saved = []  # flash: what each step's kernel backward needs besides the tensors
        for step in range(cp):
            src = (cp_rank - step) % cp
            if step + 1 < cp:
                incoming = torch.empty_like(kv)
                requests = _ring_exchange(kv, incoming, ranks, cp_rank, group, KV_TAG)
            rows, cols = _step_blocks(step, src, cp_rank, chunk)
            kb, vb = expand_heads(kv[0][:, :, cols], heads), expand_heads(kv[1][:, :, cols], heads)
            if flash:
                out_b, lse_b, meta = flash_forward(q[:, :, rows], kb, vb, step == 0, scale)
                saved.append(meta)
            else:
                out_b, lse_b = block_forward(q[:, :, rows], kb, vb, positions[cp_rank][rows], positions[src][cols],
                                             scale, dropout)
            if step == 0:
                out, lse = out_b, lse_b
            else:
                merge(out[:, :, rows], lse[:, :, rows], out_b, lse_b)
            if step + 1 < cp:
                _wait(requests)
                kv = incoming
        result = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, result if flash else out, lse)  # flash: the kernel's backward takes q's dtype
        ctx.meta = (seq_length, group, ranks, cp_rank, groups, heads, dropout, saved if flash else None)
        return result

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        seq_length, group, ranks, cp_rank, groups, heads, dropout, saved = ctx.meta
        cp, scale, chunk = len(ranks), 1.0 / math.sqrt(q.shape[-1]), q.shape[2] // 2
        positions = [cp_positions(seq_length, cp, j, q.device) for j in range(cp)]
        if saved is None:  # (the flash kernel's backward forms delta itself)
            delta = (dout.float() * out).sum(dim=-1)
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        kv = torch.stack([k, v])
        grad_in = grad_requests = None
        for step in range(cp):
            src = (cp_rank - step) % cp
            if step + 1 < cp:
                incoming = torch.empty_like(kv)
                requests = _ring_exchange(kv, incoming, ranks, cp_rank, group, KV_TAG)
            rows, cols = _step_blocks(step, src, cp_rank, chunk)
            kb, vb = expand_heads(kv[0][:, :, cols], heads), expand_heads(kv[1][:, :, cols], heads)
            if saved is not None:
                dq_b, dk_b, dv_b = (t.float() for t in flash_backward(dout[:, :, rows], q[:, :, rows], kb, vb,
                                                                      out[:, :, rows], lse[:, :, rows], step == 0,
                                                                      scale, saved[step]))
            else:
                dq_b, dk_b, dv_b = block_backward(q[:, :, rows], kb, vb, positions[cp_rank][rows],
                                                  positions[src][cols], scale, lse[:, :, rows], dout[:, :, rows],
                                                  delta[:, :, rows], dropout)
            dq[:, :, rows] += dq_b
            grad = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
            grad[0][:, :, cols] = sum_heads(dk_b, groups)
            grad[1][:, :, cols] = sum_heads(dv_b, groups)
            if cp == 1:  # a ring of one rank (a2a+p2p with one all-to-all group): nothing travels
                grad_in = grad
                continue
            if grad_requests is not None:  # the accumulator of block src from the ranks before me
                _wait(grad_requests)
                grad += grad_in
            grad_in = torch.empty_like(grad)
            grad_requests = _ring_exchange(grad, grad_in, ranks, cp_rank, group, GRAD_TAG)
            if step + 1 < cp:
                _wait(requests)
                kv = incoming
        if grad_requests is not None:
            _wait(grad_requests)  # after CP hops: my own block's dK/dV from every rank
        return dq.to(q.dtype), grad_in[0].to(k.dtype), grad_in[1].to(v.dtype), None, None, None, None, None, None


def ring_attention(q, k, v, seq_length: int, group, ranks, cp_rank: int, dropout=None, flash: bool = False):
    """q [b, heads, 2c, d], k and v [b, groups, 2c, d] of this CP rank's chunks -> context [b, heads, 2c, d];
    `dropout`: block_attention.Dropout or None (the block path only); `flash`: each block by torch's flash
    kernel (flash_blocks.py), which the caller has checked serves these inputs."""
    if flash and dropout is not None:
        raise ValueError("the flash path of ring attention has no attention dropout; use the block path")
    return RingAttention.apply(q, k, v, seq_length, group, ranks, cp_rank, dropout, flash)
