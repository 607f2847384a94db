"""`--cp-comm-type all_gather`: causal attention over a context-parallel sequence by gathering K/V.

Every CP rank all-gathers the K/V heads (GQA: the groups only) of the whole sequence, in rank order
(each rank's two chunks; the causal mask works on positions, so the keys' order does not matter), and
attends its local queries to them: one block_forward over [local queries] x [all keys]. Backward
gathers K/V again (nothing gathered is kept between forward and backward), computes dQ and the
whole sequence's dK/dV, and reduce-scatters dK/dV (fp32) back to the ranks that own them.
"""
from __future__ import annotations

import math

import torch

from ..distributed import shm_comm
from .block_attention import block_backward, block_forward, expand_heads, sum_heads
from .chunks import cp_positions


def _gather_kv(kv: torch.Tensor, cp: int, group) -> torch.Tensor:
    """[2, b, g, s_local, d] from every rank -> [2, b, g, cp * s_local, d] (rank after rank)."""
    gathered = torch.empty((cp, *kv.shape), dtype=kv.dtype, device=kv.device)
    shm_comm.all_gather_into_tensor(gathered, kv.contiguous(), group)
    two, b, g, s, d = kv.shape
    return gathered.permute(1, 2, 3, 0, 4, 5).reshape(two, b, g, cp * s, d)


class AllGatherAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, seq_length: int, group, cp: int, cp_rank: int, dropout=None):
        heads = q.shape[1]
        kv = _gather_kv(torch.stack([k, v]), cp, group)
        key_pos = torch.cat([cp_positions(seq_length, cp, j, q.device) for j in range(cp)])
        out, lse = block_forward(q, expand_heads(kv[0], heads), expand_heads(kv[1], heads),
                                 cp_positions(seq_length, cp, cp_rank, q.device), key_pos, 1.0 / math.sqrt(q.shape[-1]),
                                 dropout)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.meta = (seq_length, group, cp, cp_rank, dropout)
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        seq_length, group, cp, cp_rank, dropout = ctx.meta
        heads, groups = q.shape[1], k.shape[1]
        kv = _gather_kv(torch.stack([k, v]), cp, group)
        key_pos = torch.cat([cp_positions(seq_length, cp, j, q.device) for j in range(cp)])
        delta = (dout.float() * out).sum(dim=-1)
        dq, dk, dv = block_backward(q, expand_heads(kv[0], heads), expand_heads(kv[1], heads),
                                    cp_positions(seq_length, cp, cp_rank, q.device), key_pos,
                                    1.0 / math.sqrt(q.shape[-1]), lse, dout, delta, dropout)
        b, _, s_all, d = dk.shape
        whole = torch.stack([sum_heads(dk, groups), sum_heads(dv, groups)])  # [2, b, g, cp * s, d]
        per_rank = whole.view(2, b, groups, cp, s_all // cp, d).permute(3, 0, 1, 2, 4, 5).contiguous()
        mine = torch.empty(per_rank.shape[1:], dtype=torch.float32, device=q.device)
        shm_comm.reduce_scatter_tensor(mine, per_rank, group)
        return dq.to(q.dtype), mine[0].to(k.dtype), mine[1].to(v.dtype), None, None, None, None, None


def all_gather_attention(q, k, v, seq_length: int, group, cp: int, cp_rank: int, dropout=None):
    """q [b, heads, 2c, d], k and v [b, groups, 2c, d] of this CP rank's chunks -> context [b, heads, 2c, d];
    `dropout`: block_attention.Dropout or None."""
    return AllGatherAttention.apply(q, k, v, seq_length, group, cp, cp_rank, dropout)
