"""`--cp-comm-type a2a`: DeepSpeed-Ulysses' head scatter for causal attention over a context-parallel sequence.

An all-to-all turns this rank's tokens of every head, [b, heads, s / cp, d], into every token of its
heads / cp heads, [b, heads / cp, s, d]; the whole-sequence attention then runs with any backend of
model/attention_core.py (SDPA's flash kernels included, and attention dropout), and a second all-to-all
brings the context back to [b, heads, s / cp, d] (the caller hands the attention in as `core`, so this
package does not depend on model/). Each all-to-all's backward is the other one. The
gathered tokens arrive rank after rank (each rank's two load-balanced chunks, chunks.py), so they are put
into position order before the attention and back after it. K/V travel as their KV groups when the
groups divide over CP (GQA sends only the KV heads), else expanded to the query heads first.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from .block_attention import expand_heads
from ..tensor_parallel.conjugate import conjugate_pair
from .chunks import cp_positions


def _seq_to_heads(x: torch.Tensor, group, cp: int) -> torch.Tensor:
    """[b, n, s, d] (my tokens, every head) -> [b, n / cp, cp s, d] (every rank's tokens, my heads)."""
    b, n, s, d = x.shape
    send = x.reshape(b, cp, n // cp, s, d).transpose(0, 1).contiguous()  # [cp, b, n / cp, s, d]: part j to rank j
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return recv.permute(1, 2, 0, 3, 4).reshape(b, n // cp, cp * s, d)


def _heads_to_seq(y: torch.Tensor, group, cp: int) -> torch.Tensor:
    """The inverse: [b, m, cp s, d] (every rank's tokens, my heads) -> [b, cp m, s, d]."""
    b, m, whole, d = y.shape
    send = y.reshape(b, m, cp, whole // cp, d).permute(2, 0, 1, 3, 4).contiguous()  # part j: rank j's tokens
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return recv.transpose(0, 1).reshape(b, cp * m, whole // cp, d)


SeqToHeads, HeadsToSeq = conjugate_pair(_seq_to_heads, _heads_to_seq)  # each the other's backward


def ulysses_attention(q, k, v, group, core: Callable):
    """q [b, heads, s / cp, d], k and v [b, groups, s / cp, d] -> context [b, heads, s / cp, d];
    core(q, k, v): causal attention of whole sequences with K/V expanded to the query heads."""
    cp, heads = dist.get_world_size(group), q.shape[1]
    if heads % cp:
        raise ValueError(f"a2a context parallelism scatters the {heads} attention heads of a tensor-parallel rank "
                         f"over {cp} ranks, which does not divide them")
    if k.shape[1] % cp:
        k, v = expand_heads(k, heads), expand_heads(v, heads)
    whole = q.shape[2] * cp
    order = torch.argsort(torch.cat([cp_positions(whole, cp, j, q.device) for j in range(cp)]))
    q, k, v = (SeqToHeads.apply(t, group, cp)[:, :, order] for t in (q, k, v))
    context = core(q, expand_heads(k, q.shape[1]), expand_heads(v, q.shape[1]))
    arrived = torch.empty_like(order)
    arrived[order] = torch.arange(whole, device=q.device)
    return HeadsToSeq.apply(context[:, :, arrived], group, cp)
