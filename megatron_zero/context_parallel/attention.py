"""The attention core of a context-parallel rank: `--cp-comm-type` picks how K/V reach the queries."""
from __future__ import annotations

import torch
import torch.distributed as dist

from .all_gather_attention import all_gather_attention
from .ring_attention import ring_attention

CP_COMM_TYPES = ("p2p", "all_gather")


def context_parallel_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp_group, comm_type: str):
    """Causal attention of this CP rank's queries over the whole sequence: q [b, heads, s / cp, d], k and v
    [b, groups, s / cp, d] (the KV heads, not expanded) -> context [b, heads, s / cp, d]."""
    cp, cp_rank = dist.get_world_size(cp_group), dist.get_rank(cp_group)
    seq_length = q.shape[2] * cp
    if comm_type == "p2p":
        return ring_attention(q, k, v, seq_length, cp_group, dist.get_process_group_ranks(cp_group), cp_rank)
    if comm_type == "all_gather":
        return all_gather_attention(q, k, v, seq_length, cp_group, cp, cp_rank)
    raise ValueError(f"--cp-comm-type must be one of {', '.join(CP_COMM_TYPES)}, got {comm_type!r}")
