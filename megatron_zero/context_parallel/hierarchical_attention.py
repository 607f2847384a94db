"""`--cp-comm-type a2a+p2p`: Megatron-Core's hierarchical context parallelism (`--hierarchical-context-parallel-sizes
A P`, A x P = CP). An all-to-all over A consecutive CP ranks scatters the heads and gathers those ranks' tokens
(ulysses_attention.py's exchange); a ring over the P ranks holding the same place in their A-groups then
passes K/V (ring_attention.py), so the all-to-all stays within a node and only the ring crosses nodes.

With the load-balanced chunks (chunks.py), A-group j (CP ranks jA .. jA + A - 1) holds chunks jA .. jA + A - 1
and 2CP - (j + 1)A .. 2CP - 1 - jA: two contiguous runs, which are chunks j and 2P - 1 - j of the sequence cut
in 2P chunks, the ring's load-balanced layout over P ranks. The gathered tokens arrive rank after rank (each
rank's two chunks), so they are put in the ring's order (the ranks' first chunks ascending, then their second
chunks descending) before the ring and back after it.

    CP = 4, A = 2, P = 2, chunks 0..7:  rank 0 [0 7]  rank 1 [1 6]  rank 2 [2 5]  rank 3 [3 4]
    after the all-to-all of A-group 0 (ranks 0, 1): [0 7 1 6] -> ring order [0 1 | 6 7] (P-rank 0's two chunks)
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .block_attention import expand_heads
from .ring_attention import ring_attention
from .ulysses_attention import HeadsToSeq, SeqToHeads


def ring_order(a: int, local: int, device=None) -> torch.Tensor:
    """The gathered rows [rank 0's two chunks, rank 1's, ...] of an A-group, `local` rows a rank, as the
    ring's local sequence: every rank's first chunk in rank order, then every second chunk in reverse."""
    c = local // 2
    firsts = [torch.arange(i * local, i * local + c, device=device) for i in range(a)]
    seconds = [torch.arange(i * local + c, (i + 1) * local, device=device) for i in reversed(range(a))]
    return torch.cat(firsts + seconds)


def hierarchical_attention(q, k, v, seq_length: int, a2a_group, p2p_group, dropout=None, flash: bool = False):
    """q [b, heads, s / cp, d], k and v [b, groups, s / cp, d] of this CP rank's chunks -> context
    [b, heads, s / cp, d]; `dropout`: block_attention.Dropout or None (the ring's masks); `flash`: the
    ring's blocks by torch's flash kernel (ring_attention.py)."""
    a, heads = dist.get_world_size(a2a_group), q.shape[1]
    if heads % a:
        raise ValueError(f"a2a+p2p context parallelism scatters the {heads} attention heads of a tensor-parallel "
                         f"rank over its all-to-all groups of {a} ranks, which does not divide them")
    if k.shape[1] % a:
        k, v = expand_heads(k, heads), expand_heads(v, heads)
    order = ring_order(a, q.shape[2], q.device)
    q, k, v = (SeqToHeads.apply(t, a2a_group, a)[:, :, order] for t in (q, k, v))
    context = ring_attention(q, k, v, seq_length, p2p_group, dist.get_process_group_ranks(p2p_group),
                             dist.get_rank(p2p_group), dropout, flash)
    arrived = torch.empty_like(order)
    arrived[order] = torch.arange(order.numel(), device=q.device)
    return HeadsToSeq.apply(context[:, :, arrived], a2a_group, a)
