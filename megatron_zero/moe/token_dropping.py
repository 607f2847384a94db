"""Megatron-Core's expert capacity (--moe-expert-capacity-factor, --moe-token-drop-policy,
--moe-pad-expert-input-to-capacity): which routed (token, expert) pairs an expert keeps, as
megatron.core.transformer.moe.moe_utils.apply_router_token_dropping decides.

    capacity = ceil(T k / E x factor)       T: this rank's tokens of the micro-batch (get_capacity)
    capacity >= T: nothing is dropped
    probs:     an expert keeps the `capacity` pairs routed to it with the highest router weights
    position:  an expert keeps the first `capacity` pairs routed to it in Megatron-Core's token order
               (sequence position first, then the sample: [s, b] flattened), the later ones are dropped

The router's choices and weights are those of the dropless router (router.py), computed before
dropping; the aux losses count the routing before dropping too, as Megatron-Core's do. A dropped pair
gets expert id E in layer.py: it sorts past every expert's run and is cut off before dispatch, so no
expert sees it and its token gets nothing from that expert (the residual carries it).

Padding (--moe-pad-expert-input-to-capacity) makes Megatron-Core give each expert exactly `capacity`
rows: its kept pairs and, to fill up, tokens not routed to it with router weight 0. Those rows add
0 x expert(row) to their tokens and nothing to any gradient, so padding changes the shapes the experts
see and no result; here the experts run on their kept rows only and the flag changes nothing else.

Every rank of a tensor-parallel group routes the same tokens and drops the same pairs (no draw, no
collective); an expert-parallel or data-parallel rank drops among its own tokens, as each of
Megatron-Core's ranks does, so a layout drops what the single-process reference drops fed the same
micro-batches.
"""
from __future__ import annotations

import math

import torch


def expert_capacity(tokens: int, experts: int, topk: int, factor: float) -> int:
    """Megatron-Core's get_capacity(num_tokens=T k, num_experts=E, capacity_factor=factor)."""
    return math.ceil((tokens * topk / experts) * factor)


def megatron_token_order(batch: int, seq: int, device) -> torch.Tensor:
    """Our token index ([b, s] flattened) of Megatron-Core's j-th token ([s, b] flattened)."""
    return torch.arange(batch * seq, device=device).view(batch, seq).t().reshape(-1)


def kept_pairs(weights: torch.Tensor, expert_ids: torch.Tensor, num_experts: int, factor: float, policy: str,
               batch: int) -> torch.Tensor:
    """weights, expert_ids [T, k] (T = batch x seq tokens, batch-major) -> kept [T, k] bool."""
    tokens, topk = expert_ids.shape
    cap = expert_capacity(tokens, num_experts, topk, factor)
    if cap > tokens:
        return torch.ones_like(expert_ids, dtype=torch.bool)
    routed = torch.zeros(tokens, num_experts, dtype=torch.bool, device=expert_ids.device).scatter(1, expert_ids, True)
    if policy == "probs":
        probs = torch.zeros(tokens, num_experts, dtype=weights.dtype, device=weights.device).scatter(
            1, expert_ids, weights.detach())
        top = torch.topk(probs, k=cap, dim=0, sorted=False)[1]
        within = torch.zeros_like(routed).scatter(0, top, True)
    elif policy == "position":
        order = megatron_token_order(batch, tokens // batch, expert_ids.device)
        in_order = routed.index_select(0, order)
        first = in_order & (torch.cumsum(in_order.int(), dim=0) <= cap)
        within = torch.zeros_like(routed).index_copy(0, order, first)
    else:
        raise ValueError(f"token drop policy {policy!r} is not 'probs' or 'position'")
    return (routed & within).gather(1, expert_ids)
