"""Attention of some queries against one block of keys, by token positions, with its log-sum-exp: the
pieces all-gather context parallelism assembles, and the ring where torch's flash kernel does not serve
(flash_blocks.py; fp32 accumulation whatever the input dtype). `merge` combines the blocks of either.

A query at position i sees a key at position j iff j <= i (causal). A block's partial result is
(out_b, lse_b), out_b = softmax over the block's keys @ v, lse_b = log sum exp of the block's scores;
partial results over disjoint key blocks merge exactly (online softmax, `merge`). A query that sees no
key of a block has lse_b = -inf and out_b = 0, which `merge` ignores. The backward of a block needs the
final lse and delta = rowsum(dout * out) only (FlashAttention's recomputation), so nothing s x s is kept
between forward and backward; both run by QUERY_ROWS queries at a time, so the transient scores are
[b, h, QUERY_ROWS, keys of the block], not the block's whole square.

Attention dropout (`Dropout`): whether probability (i, j) of head h of sample b is kept is a hash of
(seed, b, h, position i, position j), so the mask does not depend on how the keys are cut into blocks or
which rank computes a block, and the backward draws the same mask again without storing it. The
log-sum-exp is taken before dropout (as FlashAttention does), so blocks merge as without it.
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Tuple

import torch

QUERY_ROWS = 128  # queries per piece of a block: bounds the scores held at once


_MASK31 = (1 << 31) - 1
_MIX = ((1103515245, 12345), (2654435761 & _MASK31, 40503), (2246822519 & _MASK31, 3266489917 & _MASK31))


class Dropout(NamedTuple):
    """Attention dropout of a block computation: drop probability p, and the seed its masks hash."""
    p: float
    seed: int


def keep_mask(dropout: Dropout, b: int, h: int, q_pos, k_pos) -> torch.Tensor:
    """[b, h, len(q_pos), len(k_pos)] bool: which probabilities survive, a function of (seed, sample, head,
    query position, key position) only (31-bit integer mixing rounds: no int64 overflow)."""
    dev = q_pos.device
    x = (torch.arange(b, device=dev).view(b, 1, 1, 1) * 1000003 + torch.arange(h, device=dev).view(1, h, 1, 1)
         * 8191 + dropout.seed) & _MASK31
    x = (x * 69069 + q_pos.view(1, 1, -1, 1)) & _MASK31
    x = (x * 69069 + k_pos.view(1, 1, 1, -1)) & _MASK31
    for mul, add in _MIX:
        x = x ^ (x >> 15)
        x = (x * mul + add) & _MASK31
    x = x ^ (x >> 16)
    return x >= int(dropout.p * (_MASK31 + 1))


def _dropped(p, dropout: Optional[Dropout], q_pos, k_pos):
    """p with dropout's mask applied and the kept entries scaled by 1 / (1 - p) (p itself without dropout)."""
    if dropout is None or dropout.p == 0:
        return p
    return p * keep_mask(dropout, p.shape[0], p.shape[1], q_pos, k_pos) / (1.0 - dropout.p)


def _scores(q, k, q_pos, k_pos, scale):
    s = torch.matmul(q.float(), k.float().transpose(-2, -1)) * scale
    return s.masked_fill(k_pos[None, :] > q_pos[:, None], float("-inf"))


def block_forward(q, k, v, q_pos, k_pos, scale: float,
                  dropout: Optional[Dropout] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """q [b, h, sq, d], k and v [b, h, sk, d] (heads expanded), positions [sq] and [sk]
    -> out [b, h, sq, d] (fp32), lse [b, h, sq] (fp32; -inf where a query sees none of these keys).
    By QUERY_ROWS queries at a time, so the scores held at once are [b, h, QUERY_ROWS, sk]."""
    outs, lses = [], []
    for rows in _row_blocks(q.shape[2]):
        s = _scores(q[:, :, rows], k, q_pos[rows], k_pos, scale)
        lse = torch.logsumexp(s, dim=-1)
        p = torch.exp(s - lse.masked_fill(torch.isinf(lse), 0.0).unsqueeze(-1))
        outs.append(torch.matmul(_dropped(p, dropout, q_pos[rows], k_pos), v.float()))
        lses.append(lse)
    return torch.cat(outs, dim=2), torch.cat(lses, dim=2)


def merge(out: torch.Tensor, lse: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor):
    """Combine two partial results over disjoint key sets (in place into out, lse; lse must be finite)."""
    new = torch.logaddexp(lse, lse_b)
    out.mul_(torch.exp(lse - new).unsqueeze(-1)).add_(out_b * torch.exp(lse_b - new).unsqueeze(-1))
    lse.copy_(new)


def block_backward(q, k, v, q_pos, k_pos, scale: float, lse, dout, delta, dropout: Optional[Dropout] = None):
    """Gradients of one block given the final lse [b, h, sq] and delta = rowsum(dout * out) [b, h, sq]:
    -> dq [b, h, sq, d], dk and dv [b, h, sk, d] (fp32). By QUERY_ROWS queries at a time."""
    kf, vf = k.float(), v.float()
    dq = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
    dv = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
    for rows in _row_blocks(q.shape[2]):
        qr, do = q[:, :, rows].float(), dout[:, :, rows].float()
        p = torch.exp(_scores(qr, k, q_pos[rows], k_pos, scale) - lse[:, :, rows].unsqueeze(-1))
        dv += torch.matmul(_dropped(p, dropout, q_pos[rows], k_pos).transpose(-2, -1), do)
        dp = _dropped(torch.matmul(do, vf.transpose(-2, -1)), dropout, q_pos[rows], k_pos)
        ds = p * (dp - delta[:, :, rows].unsqueeze(-1))
        dq[:, :, rows] = torch.matmul(ds, kf) * scale
        dk += torch.matmul(ds.transpose(-2, -1), qr) * scale
    return dq, dk, dv


def _row_blocks(n: int):
    return [slice(a, min(a + QUERY_ROWS, n)) for a in range(0, n, QUERY_ROWS)]


def expand_heads(t: torch.Tensor, heads: int) -> torch.Tensor:
    """[b, groups, s, d] -> [b, heads, s, d]: each KV group serves heads / groups query heads in a row."""
    groups = t.shape[1]
    return t if groups == heads else t.repeat_interleave(heads // groups, dim=1)


def sum_heads(t: torch.Tensor, groups: int) -> torch.Tensor:
    """The gradient of `expand_heads`: [b, heads, s, d] -> [b, groups, s, d]."""
    b, heads, s, d = t.shape
    return t if groups == heads else t.view(b, groups, heads // groups, s, d).sum(dim=2)
