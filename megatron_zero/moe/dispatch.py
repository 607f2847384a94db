"""Token permutation and the expert-parallel all-to-all, with no Python loop over tokens.

    permute:    the T x k (token, expert) pairs sorted by expert id (a stable argsort), the tokens'
                rows gathered in that order (index_select): each expert's tokens are one contiguous run
    all-to-all: with EP > 1, rank r owns experts [r E/EP, (r+1) E/EP); the runs go to their owners
                (`dist.all_to_all_single` with variable split sizes, differentiable: backward is the
                reverse exchange), and the received rows, ordered by source rank then local expert, are
                sorted by local expert once more
    unpermute:  the reverse exchange and order, each row times its router weight, added into its token's
                row (index_add): a token's k expert outputs are summed
    capacity:   (token, expert) pairs the capacity gating drops carry the expert id E: they sort after
                every expert's run and are cut off, so no expert sees them and their tokens get nothing

The split sizes are host integers: each MoE layer's dispatch exchanges its per-expert counts (one
all-to-all of E integers) and reads them on the host, as Megatron-Core's alltoall dispatcher does.
"""
from __future__ import annotations

from typing import List, Optional

import torch
import torch.distributed as dist


class AllToAll(torch.autograd.Function):
    """all_to_all_single(x) with `send` rows to each rank and `recv` rows from each; backward swaps them."""

    @staticmethod
    def forward(ctx, x, send: List[int], recv: List[int], group):
        ctx.send, ctx.recv, ctx.group = send, recv, group
        out = x.new_empty((sum(recv),) + tuple(x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), recv, send, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return AllToAll.apply(grad.contiguous(), ctx.recv, ctx.send, ctx.group), None, None, None


def sort_by_expert(expert_ids: torch.Tensor) -> torch.Tensor:
    """The permutation that groups flat (token, slot) pairs by expert id, keeping token order within one."""
    return torch.argsort(expert_ids, stable=True)


def permute(tokens: torch.Tensor, expert_ids: torch.Tensor, rows: Optional[int] = None):
    """tokens [T, h], expert_ids [T, k] -> (rows [T k, h] grouped by expert, order [T k], token of each row).
    `rows`: only the first `rows` of that order (pairs dropped by capacity carry the id E and sort last)."""
    k = expert_ids.shape[1]
    order = sort_by_expert(expert_ids.reshape(-1))
    if rows is not None:
        order = order[:rows]
    token_of_row = torch.div(order, k, rounding_mode="floor")
    return tokens.index_select(0, token_of_row), order, token_of_row


def unpermute(rows: torch.Tensor, weights: torch.Tensor, order: torch.Tensor, token_of_row: torch.Tensor,
              num_tokens: int) -> torch.Tensor:
    """sum over a token's k rows of weight x expert output -> [T, h]."""
    weighted = rows * weights.reshape(-1).index_select(0, order).unsqueeze(-1).to(rows.dtype)
    out = rows.new_zeros((num_tokens, rows.shape[1]))
    return out.index_add(0, token_of_row, weighted)


class ExpertParallelExchange:
    """One MoE layer's exchange over the expert-parallel group: rows grouped by global expert in, rows
    grouped by this rank's local experts out (`to_experts`), and back (`from_experts`)."""

    def __init__(self, counts: torch.Tensor, ep_group, local_experts: int):
        ep = dist.get_world_size(ep_group)
        # counts [E] of this rank's rows per global expert; received: [EP sources, local experts]
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts.contiguous(), group=ep_group)
        send_by_expert, recv_by_expert = torch.stack([counts, received]).tolist()  # the layer's one host read
        self.group, self.local = ep_group, local_experts
        self.send = [sum(send_by_expert[r * local_experts:(r + 1) * local_experts]) for r in range(ep)]
        self.recv = [sum(recv_by_expert[r * local_experts:(r + 1) * local_experts]) for r in range(ep)]
        self.received = received
        self.rows_per_local_expert = [sum(recv_by_expert[r * local_experts + e] for r in range(ep))
                                      for e in range(local_experts)]

    def to_experts(self, rows: torch.Tensor) -> torch.Tensor:
        got = AllToAll.apply(rows, self.send, self.recv, self.group)
        ep = len(self.send)
        local_ids = torch.arange(self.local, device=rows.device).repeat(ep)
        self.regroup = sort_by_expert(torch.repeat_interleave(local_ids, self.received, output_size=sum(self.recv)))
        return got.index_select(0, self.regroup)

    def from_experts(self, rows: torch.Tensor) -> torch.Tensor:
        back = torch.empty_like(rows).index_copy(0, self.regroup, rows)
        return AllToAll.apply(back, self.recv, self.send, self.group)
