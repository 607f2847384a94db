"""DeepSpeed-MoE's capacity gating (moe/capacity_gating.py) against deepspeed.moe.sharded_moe's top1gating /
top2gating on the same fp32 logits: which tokens each expert keeps, the combine weights, l_aux, and the
gradient of (weights . R + coeff x l_aux) with respect to the logits; random token selection and top-2's
Gumbel sampling under the same seed. Then the MoE layer with capacity against a dense masked evaluation,
and the Megatron-DeepSpeed flags that choose it."""
import pytest
import torch
import torch.nn.functional as F

from megatron_zero.model.gpt import reference_model
from megatron_zero.moe import aux_losses, reset_aux_losses, set_aux_loss_scale
from megatron_zero.moe.capacity_gating import capacity, capacity_route
from megatron_zero.testing.flag_checks import BASE, refused, with_flags
from megatron_zero.testing.moe_train import moe_config
from megatron_zero.testing.tolerances import assert_close_scaled, model_rtol

sharded_moe = pytest.importorskip("deepspeed.moe.sharded_moe")

COEFF = 0.01
T, E = 64, 8


def _ours(logits, k, factor, min_cap, drop, rts, sampling, seed):
    torch.manual_seed(seed)
    set_aux_loss_scale(1.0)
    try:
        weights, experts, kept = capacity_route(logits, k, factor, min_cap, drop, rts, sampling, COEFF)
        dense = torch.zeros(logits.shape).scatter_add(1, experts, weights * kept)  # [T, E]
        l_aux = aux_losses()["load_balancing_loss"]  # l_aux, as tracked for the log
    finally:
        reset_aux_losses()
    return dense, l_aux, weights


def _deepspeed(logits, k, factor, min_cap, drop, rts, sampling, seed):
    torch.manual_seed(seed)
    if k == 1:
        l_aux, combine, _, _ = sharded_moe.top1gating(logits, factor, min_cap, drop_tokens=drop, use_rts=rts)
    else:
        l_aux, combine, _, _ = sharded_moe.top2gating(logits, factor, min_cap, drop_tokens=drop,
                                                      top2_2nd_expert_sampling=sampling)
    return combine.sum(dim=2), l_aux  # [T, E]: each token's weight on each expert


CASES = {  # name: (k, capacity factor, min capacity, drop tokens, rts, second-expert sampling)
    "top1": (1, 1.0, 4, True, False, False),
    "top1_rts": (1, 1.0, 4, True, True, False),
    "top1_min_capacity": (1, 0.25, 6, True, True, False),
    "top1_no_drop": (1, 1.0, 4, False, True, False),
    "top2": (2, 1.0, 4, True, False, False),
    "top2_sampling": (2, 1.0, 4, True, False, True),
    "top2_small_capacity": (2, 0.5, 2, True, False, True),
    "top2_no_drop": (2, 1.0, 4, False, False, True),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_gating_matches_deepspeed(name):
    k, factor, min_cap, drop, rts, sampling = CASES[name]
    gen = torch.Generator().manual_seed(11)
    # skewed logits, so that some experts are over capacity and tokens are dropped
    base = torch.randn(T, E, generator=gen) + torch.linspace(0, 2, E)
    seed = 1234
    mine = base.clone().requires_grad_()
    dense, l_aux, weights = _ours(mine, k, factor, min_cap, drop, rts, sampling, seed)
    theirs = base.clone().requires_grad_()
    ds_dense, ds_aux = _deepspeed(theirs * 1.0, k, factor, min_cap, drop, rts, sampling, seed)
    assert torch.equal(dense != 0, ds_dense != 0)  # the same (token, expert) pairs survive
    torch.testing.assert_close(dense, ds_dense, rtol=2 ** -22, atol=0)
    torch.testing.assert_close(l_aux, ds_aux.detach(), rtol=2 ** -22, atol=0)
    routed = (dense != 0).sum()
    if drop and not name.endswith("no_drop"):
        assert routed < k * T, "no token was dropped: the case does not test capacity"
    else:
        assert routed == k * T
    probe = torch.randn(T, E, generator=gen)
    (mine_grad,) = torch.autograd.grad((dense * probe).sum(), mine)  # l_aux x COEFF through AuxLossScaler
    (ds_grad,) = torch.autograd.grad((ds_dense * probe).sum() + COEFF * ds_aux, theirs)
    # softmax, then one product / quotient per weight: a few roundings of values of order 1
    torch.testing.assert_close(mine_grad, ds_grad, rtol=1e-6, atol=1e-7)


def test_capacity_is_deepspeeds():
    for tokens, experts, factor, least in ((64, 8, 1.0, 4), (100, 7, 1.1, 0), (10, 1, 1.1, 0), (16, 4, 0.2, 3)):
        want = int(sharded_moe._capacity(torch.zeros(tokens, experts), torch.tensor(factor), torch.tensor(least)))
        assert capacity(tokens, experts, factor, least) == want


def _dense_evaluation(moe, x, cfg, seed):
    """Every expert on every token, each token's output weighted by the gate (DeepSpeed's top-1: the gate
    prob of a kept token), dropped tokens zero; plus DeepSpeed's l_aux x coeff. DeepSpeed gates the tokens in
    Megatron-DeepSpeed's [s, b] order (capacity and random token selection depend on it), ours are [b, s]."""
    tokens = x.reshape(-1, cfg.hidden_size)
    b, s = x.shape[:2]
    logits = F.linear(x.transpose(0, 1).reshape(-1, cfg.hidden_size), moe.gate.wg.weight).float()
    torch.manual_seed(seed)
    l_aux, combine, _, _ = sharded_moe.top1gating(logits, cfg.moe_capacity_factor, cfg.moe_min_capacity,
                                                  use_rts=True)
    weights = combine.sum(dim=2).view(s, b, -1).transpose(0, 1).reshape(b * s, -1)  # [T, E], ours' order
    outs = torch.stack([e(tokens) for e in moe.experts.deepspeed_experts.values()], dim=1)  # [T, E, h]
    return (weights.unsqueeze(-1) * outs).sum(1).view_as(x), l_aux * cfg.moe_aux_loss_coeff, weights


def test_moe_layer_with_capacity_matches_dense_evaluation():
    cfg = moe_config(False, moe_router_topk=1, moe_z_loss_coeff=None, moe_capacity_factor=1.0, moe_min_capacity=2)
    moe = reference_model(cfg)._modules["2"].mlp.deepspeed_moe
    x = torch.randn(2, 16, cfg.hidden_size, generator=torch.Generator().manual_seed(5)).requires_grad_()
    scale = 0.25
    set_aux_loss_scale(scale)
    try:
        torch.manual_seed(7)
        out = moe(x)
        grads = torch.autograd.grad(out.square().sum(), [x, *moe.parameters()])
    finally:
        set_aux_loss_scale(1.0)
        reset_aux_losses()
    want_out, aux, weights = _dense_evaluation(moe, x, cfg, 7)
    assert 0 < (weights != 0).sum() < 32  # capacity 8 of 32 tokens per expert: some dropped
    dropped = (weights == 0).all(dim=1).view(2, 16)
    assert torch.equal(out.detach()[dropped], torch.zeros_like(out.detach()[dropped]))
    want = torch.autograd.grad(want_out.square().sum() + scale * aux, [x, *moe.parameters()])
    rtol = model_rtol(4 * (cfg.hidden_size + cfg.moe_ffn_hidden_size) + 64)
    assert_close_scaled(out.detach(), want_out.detach(), rtol, "output")
    for (name, _), got, exp in zip([("x", x), *moe.named_parameters()], grads, want):
        assert_close_scaled(got, exp, rtol, f"gradient of {name}")


def test_eval_uses_the_eval_capacity_factor():
    cfg = moe_config(False, moe_router_topk=1, moe_z_loss_coeff=None, moe_capacity_factor=0.25,
                     moe_eval_capacity_factor=4.0, moe_min_capacity=0)
    model = reference_model(cfg)
    moe = model._modules["2"].mlp.deepspeed_moe
    x = torch.randn(1, 32, cfg.hidden_size, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        trained = moe(x)
        model.eval()
        evaluated = moe(x)
    reset_aux_losses()
    assert (trained.abs().sum(-1) == 0).sum() >= 16  # capacity 2 of 32 tokens per expert: most dropped
    assert (evaluated.abs().sum(-1) == 0).sum() == 0  # capacity 32: none


MDS = {"num_experts": 4, "moe_train_capacity_factor": 1.0}


def test_megatron_deepspeed_flags_choose_capacity_gating():
    from megatron_zero.arguments import parse_args

    args = parse_args(with_flags(BASE, num_experts=4, moe_expert_parallel_size=2, moe_loss_coeff=0.01,
                                 moe_min_capacity=2, create_moe_param_group=True), world_size=2)
    assert (args.moe_capacity_factor, args.moe_eval_capacity_factor, args.moe_min_capacity) == (1.0, 1.0, 2)
    assert (args.moe_router_topk, args.moe_aux_loss_coeff, args.expert_model_parallel_size) == (1, 0.01, 2)
    assert (args.moe_layer_freq, args.moe_layer_offset, args.moe_drop_tokens) == (2, 1, True)
    core = parse_args(with_flags(BASE, num_experts=4, moe_expert_parallel_size=2, moe_aux_loss_coeff=0.01),
                      world_size=2)
    assert core.moe_capacity_factor is None and core.expert_model_parallel_size == 2  # Megatron-Core's router
    nodrop = parse_args(with_flags(BASE, num_experts=4, topk=2, disable_moe_token_dropping=True,
                                   expert_interval=1), world_size=1)
    assert (nodrop.moe_router_topk, nodrop.moe_drop_tokens, nodrop.moe_layer_freq, nodrop.moe_layer_offset) == (
        2, False, 1, 0)


@pytest.mark.parametrize("changes,world,message", [
    ({**MDS, "moe_router_topk": 1}, 1, "flags of two different routers"),
    ({**MDS, "moe_layer_freq": 2}, 1, "flags of two different routers"),
    ({**MDS, "topk": 3}, 1, "--topk 3"),
    ({"moe_train_capacity_factor": 1.0}, 1, "give --num-experts"),
    ({**MDS, "moe_expert_parallel_size": 2, "expert_model_parallel_size": 4}, 4, "name one size twice"),
    ({**MDS, "moe_min_capacity": 10 ** 6}, 1, "exceeds the"),
    ({**MDS, "expert_interval": 99}, 1, "--expert-interval 99"),
    ({**MDS, "save": "/tmp/x", "save_megatron_deepspeed_layout": True, "zero_stage": 1}, 1, "writes dense GPTs only"),
])
def test_megatron_deepspeed_moe_mixes_are_refused(changes, world, message, capsys):
    assert message in refused(with_flags(BASE, **changes), world, capsys)


@pytest.mark.parametrize("capacity_gating", [True, False])
def test_full_recompute_routes_identically_and_counts_the_losses_once(capacity_gating):
    """Full recompute (uniform, 2 layers a chunk) against none, RTS and hidden dropout drawing from the
    generator: the same loss, gradients and logged MoE losses (once, not again at the recompute)."""
    routing = (dict(moe_router_topk=1, moe_z_loss_coeff=None, moe_capacity_factor=1.0, moe_min_capacity=0)
               if capacity_gating else {})
    results = []
    for recompute in (None, "full"):
        cfg = moe_config(False, hidden_dropout=0.1, recompute_granularity=recompute,
                         recompute_method="uniform" if recompute else None, recompute_num_layers=2, **routing)
        torch.manual_seed(0)
        model = reference_model(cfg)
        tokens = torch.randint(0, 100, (4, 8), generator=torch.Generator().manual_seed(1))
        set_aux_loss_scale(0.5)
        try:
            torch.manual_seed(9)
            loss = model(tokens[:, :-1].contiguous(), labels=tokens[:, 1:].contiguous())
            grads = torch.autograd.grad(loss, list(model.parameters()))
            tracked = {k: v.clone() for k, v in aux_losses().items()}
        finally:
            set_aux_loss_scale(1.0)
            reset_aux_losses()
        results.append((loss.detach(), grads, tracked))
    (loss0, grads0, tracked0), (loss1, grads1, tracked1) = results
    assert torch.equal(loss0, loss1)
    assert tracked0.keys() == tracked1.keys() and "load_balancing_loss" in tracked0
    for name in tracked0:
        assert torch.equal(tracked0[name], tracked1[name]), name
    for g0, g1 in zip(grads0, grads1):
        torch.testing.assert_close(g1, g0, rtol=0, atol=0)
