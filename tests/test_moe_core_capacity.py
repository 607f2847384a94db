"""Megatron-Core's router options against megatron-core's own functions on the same fp32 logits (its token
order is [s, b], ours [b, s]: the tests reorder): expert capacity with --moe-token-drop-policy probs (kept
pairs and router weights identical) and position (the first tokens in Megatron-Core's order; its own code
picks among equal 0/1 entries by torch.topk, whose choice among ties on the CPU is not by position, so only
the counts are compared there), padding to capacity (Megatron-Core's router weights unchanged by it), the
sigmoid score function and the top-k scaling factor, the sequence-level aux loss (value and logit
gradients); the layer with dropping against a dense masked evaluation; the flags and their refusals."""
import math

import pytest
import torch
import torch.nn.functional as F

from megatron_zero.arguments import parse_args
from megatron_zero.model.gpt import reference_model
from megatron_zero.moe import aux_losses, reset_aux_losses, set_aux_loss_scale
from megatron_zero.moe.router import route, scores_and_choice, scores_for_aux_loss, seq_load_balancing_loss
from megatron_zero.moe.token_dropping import expert_capacity, kept_pairs
from megatron_zero.testing.flag_checks import BASE, refused, with_flags
from megatron_zero.testing.moe_train import moe_config
from megatron_zero.testing.tolerances import assert_close_scaled, model_rtol

moe_utils = pytest.importorskip("megatron.core.transformer.moe.moe_utils")

B, S, E, K = 2, 16, 8, 2
ROUTERS = [("softmax", False, None), ("softmax", True, 2.5), ("sigmoid", False, None), ("sigmoid", False, 2.5)]
FACTORS = (0.5, 1.0, 1.5, 4.0)


def _to_megatron(t, b=B):
    """[b s, ...] batch-major rows -> Megatron-Core's [s b, ...] order."""
    return t.reshape(b, -1, *t.shape[1:]).transpose(0, 1).reshape(t.shape)


def _from_megatron(t, b=B):
    return t.reshape(-1, b, *t.shape[1:]).transpose(0, 1).reshape(t.shape)


def _logits(seed):
    return torch.randn(B * S, E, generator=torch.Generator().manual_seed(seed))


def _dense(ids, values):
    return torch.zeros(ids.shape[0], E, dtype=values.dtype).scatter(1, ids, values)


@pytest.mark.parametrize("score,pre,scale", ROUTERS)
def test_capacity_drops_what_megatron_core_drops(score, pre, scale):
    for seed, factor in enumerate(FACTORS):
        logits = _logits(seed)
        probs, routing_map = moe_utils.topk_routing_with_score_function(
            _to_megatron(logits), K, use_pre_softmax=pre, scaling_factor=scale, score_function=score)
        weights, ids = scores_and_choice(logits, K, pre, score, scale)
        # the router itself: the same choices and weights (the same fp32 operations: bit-identical)
        assert torch.equal(_to_megatron(_dense(ids, weights)), probs)
        assert expert_capacity(B * S, E, K, factor) == moe_utils.get_capacity(B * S * K, E, factor)
        kept = kept_pairs(weights, ids, E, factor, "probs", B)
        want_probs, want_map = moe_utils.apply_router_token_dropping(probs, routing_map, K, factor, "probs")
        assert torch.equal(_to_megatron(_dense(ids, kept)), want_map), f"probs policy, factor {factor}"
        assert torch.equal(_to_megatron(_dense(ids, weights * kept)), want_probs)
        if factor < 1.5:  # capacity below some expert's load: pairs are dropped
            assert not bool(kept.all())
        # position: each expert keeps as many as Megatron-Core keeps, and those are its first tokens in [s, b] order
        kept = _to_megatron(_dense(ids, kept_pairs(weights, ids, E, factor, "position", B)))
        _, want_map = moe_utils.apply_router_token_dropping(probs, routing_map, K, factor, "position")
        assert torch.equal(kept.sum(0), want_map.sum(0)), f"position policy, factor {factor}"
        cap = expert_capacity(B * S, E, K, factor)
        assert torch.equal(kept, routing_map & (torch.cumsum(routing_map.int(), 0) <= cap))


def test_padding_to_capacity_changes_no_router_weight():
    """Megatron-Core's padded map adds rows of weight 0 to each expert: the weights a token receives are the
    unpadded ones, bit for bit (so the experts' outputs on padding rows add exactly nothing)."""
    for seed, factor in enumerate(FACTORS):
        probs, routing_map = moe_utils.topk_routing_with_score_function(_logits(seed), K)
        for policy in ("probs", "position"):
            plain, plain_map = moe_utils.apply_router_token_dropping(probs, routing_map, K, factor, policy)
            padded, padded_map = moe_utils.apply_router_token_dropping(probs, routing_map, K, factor, policy, True)
            assert torch.equal(plain, padded)
            assert int(padded_map.sum()) >= int(plain_map.sum())
            assert not bool(padded[padded_map & ~plain_map].any())


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
def test_seq_aux_loss_matches_megatron_core(score):
    """Megatron-Core's Router._apply_seq_aux_loss on one rank: [s, b E] reshaped scores and routing map
    through switch_load_balancing_loss_func, divided by b; the value and the logits' gradient."""
    coeff = 1e-2
    logits = _logits(7).requires_grad_()
    scores, chosen = scores_for_aux_loss(logits, K, score)
    counts = torch.zeros(B, S, E).scatter(2, chosen.view(B, S, K), 1.0).sum(1)
    ours = seq_load_balancing_loss(scores, counts, B, K, coeff)
    (got,) = torch.autograd.grad(ours, logits)
    mlogits = _to_megatron(logits.detach()).requires_grad_()
    routing_map, mscores = moe_utils.compute_routing_scores_for_aux_loss(mlogits, K, score)
    want = moe_utils.switch_load_balancing_loss_func(
        mscores.reshape(S, -1), routing_map.reshape(S, -1).sum(0), S, K, E, coeff) / B
    (want_grad,) = torch.autograd.grad(want, mlogits)
    # sums of S B E terms in another order: a few ulps of the loss; gradients: elementwise products, one sum of E
    eps = torch.finfo(torch.float32).eps
    assert abs(float(ours) - float(want)) <= 4 * S * E * eps * abs(float(want))
    assert_close_scaled(_to_megatron(got), want_grad, 4 * E * eps, "seq aux loss gradient")
    # the router's wiring: the tracked value (loss / coeff) and, through AuxLossScaler at scale 1, the gradient
    routed = logits.detach().requires_grad_()
    set_aux_loss_scale(1.0)
    weights, _ = route(routed, K, False, "seq_aux_loss", coeff, None, score, None, B)
    (through,) = torch.autograd.grad((weights * 0).sum(), routed)
    tracked = float(aux_losses()["seq_load_balancing_loss"]) * coeff
    reset_aux_losses()
    assert abs(tracked - float(want)) <= 4 * S * E * eps * abs(float(want))
    assert_close_scaled(_to_megatron(through), want_grad, 4 * E * eps, "seq aux loss gradient through the router")


def _dense_capacity_evaluation(cfg, moe, x, policy):
    """Every expert on every token, each token weighted by its kept experts' router weights (the mask built
    from megatron-core's apply_router_token_dropping in its token order)."""
    tokens = x.reshape(-1, cfg.hidden_size)
    logits = F.linear(tokens, moe.gate.wg.weight).float()
    b = x.shape[0]
    weights, ids = scores_and_choice(logits, cfg.moe_router_topk, False, "softmax", None)
    probs = _to_megatron(torch.zeros_like(logits).scatter(1, ids, weights), b)
    routing_map = probs > 0
    final, _ = moe_utils.apply_router_token_dropping(probs, routing_map, cfg.moe_router_topk,
                                                     cfg.moe_expert_capacity_factor, policy)
    if policy == "position":  # by position, as its documentation says (its CPU topk breaks ties otherwise)
        cap = expert_capacity(tokens.shape[0], cfg.num_experts, cfg.moe_router_topk, cfg.moe_expert_capacity_factor)
        final = probs * (routing_map & (torch.cumsum(routing_map.int(), 0) <= cap))
    mask = _from_megatron(final, b)  # back to [b s] order
    outs = torch.stack([e(tokens) for e in moe.experts.deepspeed_experts.values()], dim=1)
    return (mask.unsqueeze(-1) * outs).sum(1).view_as(x), mask


@pytest.mark.parametrize("policy,llama", [("probs", False), ("position", True)])
def test_layer_with_capacity_matches_dense_evaluation(policy, llama):
    cfg = moe_config(llama, moe_expert_capacity_factor=0.5, moe_token_drop_policy=policy, moe_aux_loss_coeff=0.0,
                     moe_z_loss_coeff=None)
    moe = reference_model(cfg)._modules["2"].mlp.deepspeed_moe
    x = torch.randn(2, 8, cfg.hidden_size, generator=torch.Generator().manual_seed(5)).requires_grad_()
    set_aux_loss_scale(1.0)
    out = moe(x)
    grads = torch.autograd.grad(out.square().sum(), [x, *moe.parameters()])
    reset_aux_losses()
    want_out, mask = _dense_capacity_evaluation(cfg, moe, x, policy)
    assert int((mask > 0).sum()) < x.shape[0] * x.shape[1] * cfg.moe_router_topk  # pairs were dropped
    want = torch.autograd.grad(want_out.square().sum(), [x, *moe.parameters()])
    rtol = model_rtol(4 * (cfg.hidden_size + cfg.moe_ffn_hidden_size) + 2 * 16)
    assert_close_scaled(out.detach(), want_out.detach(), rtol, "output")
    for (name, _), got, exp in zip([("x", x), *moe.named_parameters()], grads, want):
        assert_close_scaled(got, exp, rtol, f"gradient of {name}")


MOE_ARGS = {"num_experts": 4, "moe_aux_loss_coeff": 0.01}


def test_core_router_flags_parse():
    args = parse_args(with_flags(BASE, **MOE_ARGS, moe_expert_capacity_factor=1.25, moe_token_drop_policy="position",
                                 moe_pad_expert_input_to_capacity=True, moe_router_load_balancing_type="seq_aux_loss",
                                 moe_router_score_function="sigmoid", moe_router_topk_scaling_factor=2.0), world_size=1)
    assert (args.moe_expert_capacity_factor, args.moe_token_drop_policy, args.moe_pad_expert_input_to_capacity) == (
        1.25, "position", True)
    assert (args.moe_router_score_function, args.moe_router_topk_scaling_factor) == ("sigmoid", 2.0)
    negative = parse_args(with_flags(BASE, **MOE_ARGS, moe_expert_capacity_factor=-1), world_size=1)
    assert negative.moe_expert_capacity_factor is None  # Megatron-Core: dropless
    assert math.isclose(expert_capacity(32, 4, 2, 1.25), 20)


@pytest.mark.parametrize("changes,message", [
    ({**MOE_ARGS, "moe_pad_expert_input_to_capacity": True}, "give it too"),
    ({**MOE_ARGS, "moe_expert_capacity_factor": 1.0, "moe_train_capacity_factor": 1.0}, "two different routers"),
    ({"moe_expert_capacity_factor": 1.0}, "give --num-experts"),
    ({**MOE_ARGS, "moe_expert_capacity_factor": 1.0, "context_parallel_size": 2}, "--context-parallel-size 2 with an"),
])
def test_core_router_flags_refused(changes, message, capsys):
    assert message in refused(with_flags(BASE, **changes), 2, capsys)
