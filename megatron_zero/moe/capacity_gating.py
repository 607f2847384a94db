"""DeepSpeed-MoE's capacity-based gating (deepspeed/moe/sharded_moe.py top1gating / top2gating), as
Megatron-DeepSpeed's MoE layers route: same decisions, same combine weights, same aux loss.

    gates    = softmax(logits)                                   [T, E], fp32
    capacity = max(ceil(T / E * factor * k), min_capacity)       per expert, of this rank's T tokens
    top-1    expert argmax(gates); over capacity, random token selection (use_rts: each token's score is
             a uniform draw, an expert keeps its `capacity` highest; without it, torch.topk of the 0/1
             mask, DeepSpeed's order); combine weight: the gate prob of a kept token, 0 for a dropped one
    top-2    first expert argmax(gates), second argmax(logits + Gumbel noise) over the others (without
             `second_expert_sampling`: of the logits); an expert takes every token's first choice, in token
             order, then the second choices, up to its capacity; weights: the surviving gate probs divided
             by their sum
    l_aux    = E * sum_e me_e * ce_e   (me: mean gate prob; ce: fraction of tokens whose first choice is
             e, before capacity)
    drop_tokens False: nothing is dropped (DeepSpeed's capacity becomes the largest count)

A dropped (token, choice) pair gets no expert: its MoE output is zero and the residual carries the token.
The uniform and Gumbel draws come from torch's default generator, as DeepSpeed's do, so every rank of a
tensor-parallel group (seeded alike, as for hidden dropout) drops the same tokens, a fixed seed repeats
a run, and full recompute (which restores the generator) routes a layer again identically.
l_aux x coeff joins the loss through router.AuxLossScaler (Megatron-DeepSpeed adds moe_loss x coeff to
each micro-batch's loss).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .router import AuxLossScaler, track


def capacity(tokens: int, experts: int, factor: float, min_capacity: int) -> int:
    """DeepSpeed's _capacity: ceil((T / E) x factor) in fp32, at least min_capacity (a host integer)."""
    cap = torch.ceil((tokens / experts) * torch.tensor(factor, dtype=torch.float32))
    return max(int(cap), int(min_capacity))


def _top1(logits, gates, factor, min_capacity, drop_tokens, use_rts):
    tokens, experts = gates.shape
    expert = torch.argmax(gates, dim=1)
    mask = F.one_hot(expert, num_classes=experts)
    l_aux = torch.sum(torch.mean(gates, dim=0) * torch.mean(mask.float(), dim=0)) * experts
    if drop_tokens:
        cap = min(capacity(tokens, experts, factor, min_capacity), tokens)
        score = mask * torch.rand(mask.shape, device=logits.device) if use_rts else mask
        chosen = torch.zeros_like(mask).scatter_(0, torch.topk(score, k=cap, dim=0)[1], 1)
        kept = (mask * chosen).sum(dim=1).bool()
    else:
        kept = torch.ones(tokens, dtype=torch.bool, device=logits.device)
    weight = gates.gather(1, expert[:, None]) * kept[:, None]
    return l_aux, weight, expert[:, None], kept[:, None]


def _top2(logits, gates, factor, min_capacity, drop_tokens, second_expert_sampling):
    tokens, experts = gates.shape
    first = torch.argmax(gates, dim=1)
    mask1 = F.one_hot(first, num_classes=experts)
    noisy = logits.detach()
    if second_expert_sampling:
        noisy = noisy + torch.distributions.gumbel.Gumbel(torch.tensor(0.0, device=logits.device),
                                                          torch.tensor(1.0, device=logits.device)).rsample(
            logits.shape)
    second = torch.argmax(noisy.masked_fill(mask1.bool(), float("-inf")), dim=1)
    mask2 = F.one_hot(second, num_classes=experts)
    l_aux = torch.mean(torch.mean(gates, dim=0) * torch.mean(mask1.float(), dim=0)) * experts * experts
    expert = torch.stack([first, second], dim=1)
    if drop_tokens:
        cap = capacity(tokens, experts, factor * 2, min_capacity)
        slot1 = (torch.cumsum(mask1, dim=0) - 1).gather(1, first[:, None])
        slot2 = (torch.cumsum(mask2, dim=0) - 1 + mask1.sum(dim=0, keepdim=True)).gather(1, second[:, None])
        kept = torch.cat([slot1, slot2], dim=1) < cap
    else:
        kept = torch.ones(tokens, 2, dtype=torch.bool, device=logits.device)
    chosen = gates.gather(1, expert) * kept
    denom = torch.clamp(chosen.sum(dim=1, keepdim=True), min=torch.finfo(chosen.dtype).eps)
    return l_aux, chosen / denom, expert, kept


def capacity_route(logits: torch.Tensor, topk: int, capacity_factor: float, min_capacity: int,
                   drop_tokens: bool, use_rts: bool, second_expert_sampling: bool, coeff: float) -> tuple:
    """logits [T, E] (fp32) -> (weights [T, k], expert ids [T, k], kept [T, k] bool); l_aux x coeff rides
    on `weights` (its gradient in backward), l_aux is tracked as `load_balancing_loss` for the log."""
    gates = F.softmax(logits, dim=1)
    if topk == 1:
        l_aux, weights, experts, kept = _top1(logits, gates, capacity_factor, min_capacity, drop_tokens, use_rts)
    elif topk == 2:
        l_aux, weights, experts, kept = _top2(logits, gates, capacity_factor, min_capacity, drop_tokens,
                                              second_expert_sampling)
    else:
        raise ValueError(f"capacity gating routes to 1 or 2 experts, not {topk}")
    if coeff > 0:
        track("load_balancing_loss", l_aux)
        weights = AuxLossScaler.apply(weights, l_aux * coeff)
    return weights, experts, kept
