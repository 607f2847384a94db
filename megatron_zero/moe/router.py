"""The top-k router and its auxiliary losses, as Megatron-Core computes them.

    logits = x W_g^T                     [tokens, E] (W_g: `mlp.deepspeed_moe.gate.wg.weight`, replicated)
    default:       top-k of the logits, softmax over those k       (--moe-router-topk)
    pre-softmax:   softmax over all E, then its top-k              (--moe-router-pre-softmax)
    switch load balancing (--moe-router-load-balancing-type aux_loss, --moe-aux-loss-coeff c):
        aux = c * E / (T^2 k) * sum_e (sum_t softmax(logits)_te) * tokens_routed_to_e
    sequence-level (seq_aux_loss): that loss of each sequence alone (T: its tokens), averaged over the batch
        (with sequence parallelism each rank's rows counted into their sequences, summed over the TP group)
    z-loss (--moe-z-loss-coeff c_z): c_z * mean_t logsumexp(logits_t)^2
    context parallelism (`reduce_group`: the CP group, each rank routing its chunks of every sequence):
        tokens_routed_to_e (per sequence for seq_aux_loss) summed over the group, T the whole sequence's,
        and the probabilities this rank's only: the group's losses sum to the whole sequence's loss
        (Megatron-Core's tp_cp reduce group); the z-loss coefficient is divided by the group's size
    sinkhorn: top-k of the Sinkhorn-balanced scores in training, weights from sigmoid / softmax (sinkhorn.py)
    --moe-router-score-function sigmoid: top-k of sigmoid(logits), normalised to sum 1 (k > 1); the aux
        losses then take sigmoid(logits) normalised over all E; --moe-router-topk-scaling-factor s: the
        router weights times s
    --moe-router-enable-expert-bias (sigmoid): the top-k of sigmoid(logits) + b chooses the experts, the
        weights are the unbiased sigmoid(logits) at them; b, a layer's [E] state, moves after each step
        (expert_bias.py)
    --moe-router-num-groups G --moe-router-group-topk g: the E experts in G groups of E/G; a token's g groups
        of the highest sum of their top-(k/g) scores, then its top-k among those groups' experts

The losses do not join the model's output: `AuxLossScaler` returns its input unchanged and, in
backward, adds the loss's gradient times the current scale (Megatron's MoEAuxLossAutoScaler). The
training step sets that scale once per global batch to loss_scale / micro-batches
(`set_aux_loss_scale`), so the aux losses are weighted as the language-model loss is under gradient
accumulation, pipelining (the loss of a middle stage's layer never crosses a stage boundary) and
fp16 loss scaling; under context parallelism the scale is also multiplied by the CP size, as the
language-model loss of a CP rank is (Megatron-Core's schedule does the same). With sequence parallelism
(`sp_group`) each TP rank routes its own tokens: the per-expert counts are summed over the group and T
counts every rank's tokens, so each rank's loss is its tokens' share of the micro-batch's loss (Megatron-Core's
tp_cp reduce and z-loss coefficient / TP) and the router's gradient is summed over TP; the log sums the
ranks' shares over TP and CP when it reports (metrics.py), so the step runs no collective for it. Each layer's values (divided by
their coefficients, as Megatron logs them) are summed into `aux_losses()` for the log, until
`reset_aux_losses()`; a layer run again by full recompute (model/recompute.py) in backward is not counted
a second time.
"""
from __future__ import annotations

from typing import Dict

import torch
import torch.distributed as dist

from ..distributed import shm_comm
from ..tensor_parallel.random import is_recomputing
from .sinkhorn import sinkhorn_routing

_SCALE = {"value": 1.0}
_TRACKED: Dict[str, torch.Tensor] = {}


def set_aux_loss_scale(value: float) -> None:
    """The factor on the aux losses' gradients: loss_scale / number of micro-batches of the global batch."""
    _SCALE["value"] = float(value)


def track(name: str, value: torch.Tensor) -> None:
    """Add a layer's value to the log's sum (not while full recompute runs the layer again)."""
    if is_recomputing():
        return
    value = value.detach().float()
    _TRACKED[name] = _TRACKED[name] + value if name in _TRACKED else value


def aux_losses() -> Dict[str, torch.Tensor]:
    """name -> the sum over layers and micro-batches since the last reset (device tensors, no host read)."""
    return dict(_TRACKED)


def reset_aux_losses() -> None:
    _TRACKED.clear()


class AuxLossScaler(torch.autograd.Function):
    """Identity on `output`; backward also sends d(aux)/d(...) = the current scale into `aux`'s graph."""

    @staticmethod
    def forward(ctx, output, aux):
        ctx.save_for_backward(aux)
        return output

    @staticmethod
    def backward(ctx, grad_output):
        (aux,) = ctx.saved_tensors
        return grad_output, torch.full_like(aux, _SCALE["value"])


def switch_load_balancing_loss(probs: torch.Tensor, tokens_per_expert: torch.Tensor, topk: int,
                               coeff: float, tokens: int = 0) -> torch.Tensor:
    """Megatron-Core's switch_load_balancing_loss_func: probs [T_local, E] over all experts, counts [E] of
    all `tokens` (default T_local: the probabilities of every token are here)."""
    experts = probs.shape[1]
    tokens = tokens or probs.shape[0]
    return torch.sum(probs.sum(dim=0) * tokens_per_expert) * (experts * coeff / (tokens * tokens * topk))


def z_loss(logits: torch.Tensor, coeff: float) -> torch.Tensor:
    return torch.mean(torch.square(torch.logsumexp(logits, dim=-1))) * coeff


def _size(group) -> int:
    return dist.get_world_size(group) if group is not None else 1


def _group_sum(value: torch.Tensor, group) -> torch.Tensor:
    """`value` summed over `group` (a collective; no gradient; None: unchanged)."""
    if group is None:
        return value
    value = value.detach().clone()
    shm_comm.all_reduce(value, group)
    return value


def seq_load_balancing_loss(scores: torch.Tensor, tokens_per_expert: torch.Tensor, batch: int, topk: int,
                            coeff: float, parts: int = 1, sequence_of_token=None) -> torch.Tensor:
    """Megatron-Core's seq_aux_loss: the switch loss of each sequence on its own, averaged over the batch.
    scores [b s, E] (batch-major; s: this rank's `1 / parts` of each sequence), tokens_per_expert [b, E]
    (each whole sequence's routing). `sequence_of_token` [b s]: the sequence each row belongs to, where this
    rank's rows are not s of each sequence (sequence parallelism: tokens_of_sequences)."""
    tokens, experts = scores.shape
    if sequence_of_token is None:
        per_seq = scores.view(batch, tokens // batch, experts).sum(dim=1)
    else:
        per_seq = scores.new_zeros(batch, experts).index_add(0, sequence_of_token, scores)
    seq = tokens // batch * parts
    return torch.sum(per_seq * tokens_per_expert) * (experts * coeff / (topk * seq * seq)) / batch


def tokens_of_sequences(tokens: int, batch: int, sp_group, device=None) -> torch.Tensor:
    """The sequence of each of this rank's `tokens` rows: with sequence parallelism a TP rank holds its contiguous
    share of the micro-batch's batch-major tokens (tensor_parallel/mappings.py), which need not be s / TP of
    every sequence."""
    sp, rank = _size(sp_group), dist.get_rank(sp_group)
    return (rank * tokens + torch.arange(tokens, device=device)) // (tokens * sp // batch)


def group_limited_topk(scores: torch.Tensor, topk: int, num_groups: int, group_topk: int) -> tuple:
    """Megatron-Core's group_limited_topk: scores [T, E] -> (top-k scores, ids) [T, k] among each token's
    `group_topk` groups (of `num_groups` equal runs of experts) with the highest sum of top-(k / g) scores."""
    tokens, experts = scores.shape
    group_scores = scores.view(tokens, num_groups, -1).topk(topk // group_topk, dim=-1)[0].sum(dim=-1)
    group_idx = torch.topk(group_scores, k=group_topk, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
    score_mask = group_mask.unsqueeze(-1).expand(tokens, num_groups, experts // num_groups).reshape(tokens, -1)
    return torch.topk(scores.masked_fill(~score_mask.bool(), float("-inf")), k=topk, dim=-1)


def _topk(scores: torch.Tensor, topk: int, num_groups, group_topk) -> tuple:
    if group_topk:
        return group_limited_topk(scores, topk, num_groups, group_topk)
    return torch.topk(scores, topk, dim=-1)


def scores_and_choice(logits: torch.Tensor, topk: int, pre_softmax: bool, score_function: str,
                      scaling_factor, num_groups=None, group_topk=None, expert_bias=None) -> tuple:
    """Megatron-Core's topk_routing_with_score_function: (weights, ids) [T, k]. `expert_bias` [E] (sigmoid
    only): added to the scores to choose the experts; the weights are the unbiased scores at them."""
    if score_function == "sigmoid":
        scores = torch.sigmoid(logits)
        if expert_bias is not None:
            experts = _topk(scores + expert_bias, topk, num_groups, group_topk)[1]
            weights = torch.gather(scores, 1, experts)
        else:
            weights, experts = _topk(scores, topk, num_groups, group_topk)
        if topk > 1:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    elif pre_softmax:
        weights, experts = _topk(torch.softmax(logits, dim=-1), topk, num_groups, group_topk)
    else:
        top, experts = _topk(logits, topk, num_groups, group_topk)
        weights = torch.softmax(top, dim=-1)
    if scaling_factor:
        weights = weights * scaling_factor
    return weights, experts


def scores_for_aux_loss(logits: torch.Tensor, topk: int, score_function: str) -> tuple:
    """Megatron-Core's compute_routing_scores_for_aux_loss: (scores over all E [T, E], top-k ids of them)."""
    if score_function == "sigmoid":
        scores = torch.sigmoid(logits)
        scores = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
    else:
        scores = torch.softmax(logits, dim=-1)
    return scores, torch.topk(scores, topk, dim=-1)[1]


def route(logits: torch.Tensor, topk: int, pre_softmax: bool, balancing: str, aux_coeff: float,
          z_coeff, score_function: str = "softmax", scaling_factor=None, batch: int = 1, training: bool = True,
          reduce_group=None, sp_group=None, num_groups=None, group_topk=None, expert_bias=None) -> tuple:
    """logits [T, E] (fp32, T = batch x seq tokens, batch-major) -> (weights [T, k], expert ids [T, k]) with
    the aux losses attached to `weights`. `training`: Sinkhorn routing chooses by the balanced scores only
    in training (sinkhorn.py). The ranks holding the other tokens of these micro-batches: `reduce_group`
    (context parallelism: the other chunks of the sequences) and `sp_group` (sequence parallelism); None:
    all are here. Megatron-Core's tp_cp group is the two together. `num_groups`, `group_topk`: group-limited
    routing; `expert_bias` [E]: the aux-loss-free bias (sigmoid scores; see scores_and_choice)."""
    parts = _size(reduce_group) * _size(sp_group)
    if z_coeff:
        zl = z_loss(logits, z_coeff / parts)
        track("z_loss", zl / z_coeff)
        logits = AuxLossScaler.apply(logits, zl)
    if balancing == "sinkhorn":
        return sinkhorn_routing(logits, topk, training)
    weights, experts = scores_and_choice(logits, topk, pre_softmax, score_function, scaling_factor, num_groups,
                                         group_topk, expert_bias)
    if balancing in ("aux_loss", "seq_aux_loss") and aux_coeff > 0:
        scores, chosen = scores_for_aux_loss(logits, topk, score_function)
        if balancing == "aux_loss":
            counts = torch.zeros(logits.shape[1], dtype=logits.dtype, device=logits.device)
            counts.scatter_add_(0, chosen.reshape(-1), torch.ones(chosen.numel(), dtype=logits.dtype,
                                                                   device=logits.device))
            counts = _group_sum(_group_sum(counts, sp_group), reduce_group)
            aux = switch_load_balancing_loss(scores, counts, topk, aux_coeff, logits.shape[0] * parts)
            track("load_balancing_loss", aux / aux_coeff)
        else:
            if sp_group is None:
                counts = torch.zeros(batch, logits.shape[0] // batch, logits.shape[1], dtype=logits.dtype,
                                     device=logits.device)
                counts = counts.scatter_(2, chosen.view(batch, -1, topk), 1.0).sum(dim=1)
                sequence = None
            else:  # this rank's rows into their sequences' counts, summed over the TP ranks' rows
                sequence = tokens_of_sequences(logits.shape[0], batch, sp_group, logits.device)
                chosen_once = torch.zeros_like(logits).scatter_(1, chosen, 1.0)
                counts = _group_sum(logits.new_zeros(batch, logits.shape[1]).index_add(0, sequence, chosen_once),
                                    sp_group)
            aux = seq_load_balancing_loss(scores, _group_sum(counts, reduce_group), batch, topk, aux_coeff, parts,
                                          sequence)
            track("seq_load_balancing_loss", aux / aux_coeff)
        weights = AuxLossScaler.apply(weights, aux)
    return weights, experts
