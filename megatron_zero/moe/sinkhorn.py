"""`--moe-router-load-balancing-type sinkhorn`: Megatron-Core's Sinkhorn routing (TopKRouter.sinkhorn_load_balancing).

    training:    the top-k experts of sinkhorn(logits) (fp32, no gradient): exp(logits) scaled by row and
                 column factors until every expert's column carries about the same total (a balanced
                 assignment), so the choice balances the load without an aux loss
    evaluation:  the top-k of the activation itself
    activation:  sigmoid(logits) for top-1, softmax(logits) over all E for k > 1
    weights:     the activation at the chosen experts (not renormalised over the k), the gradient flowing
                 through it, never through the Sinkhorn scaling

Megatron-Core asserts --moe-aux-loss-coeff 0 with it and does not read the score function, pre-softmax or
the top-k scaling factor there; config/moe_router.py refuses those beside sinkhorn. The z-loss applies before, as
in Megatron-Core. The iteration runs until the mean change of the column factors is below 1e-4: each
iteration reads that error on the host (Megatron-Core's loop), the one place the router syncs with it.
"""
from __future__ import annotations

import torch

TOLERANCE = 1e-4
EPS = 1e-8


def sinkhorn(cost: torch.Tensor, tol: float = TOLERANCE) -> torch.Tensor:
    """Megatron-Core's moe_utils.sinkhorn: exp(cost) [T, E] balanced by row and column factors."""
    cost = torch.exp(cost)
    d0 = torch.ones(cost.size(0), device=cost.device, dtype=cost.dtype)
    d1 = torch.ones(cost.size(1), device=cost.device, dtype=cost.dtype)
    error, d1_old = 1e9, d1
    while error > tol:
        d0 = (1 / d0.size(0)) * 1 / (torch.sum(d1 * cost, 1) + EPS)
        d1 = (1 / d1.size(0)) * 1 / (torch.sum(d0.unsqueeze(1) * cost, 0) + EPS)
        error = torch.mean(torch.abs(d1_old - d1))
        d1_old = d1
    return d1 * cost * d0.unsqueeze(1)


def sinkhorn_routing(logits: torch.Tensor, topk: int, training: bool) -> tuple:
    """logits [T, E] -> (weights [T, k], expert ids [T, k])."""
    activation = torch.sigmoid(logits) if topk == 1 else torch.softmax(logits, dim=-1, dtype=torch.float32).type_as(logits)
    if training:
        with torch.no_grad():
            experts = torch.topk(sinkhorn(logits.detach().float()), k=topk, dim=1)[1]
    else:
        experts = torch.topk(activation, k=topk, dim=1)[1]
    return activation.gather(1, experts), experts
