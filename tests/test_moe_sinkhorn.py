"""--moe-router-load-balancing-type sinkhorn (moe/sinkhorn.py) against megatron-core 0.16's own TopKRouter on the
same router weight and input (its token order [s, b], ours [b, s]): the routing map equal, the router
weights and the gradients of input and weight to 1e-6 (one fp32 logit matmul of h terms, then the same
elementwise operations), top-1 (sigmoid) and top-2/4 (softmax), in training (the top-k of the Sinkhorn-balanced
scores) and in evaluation (the top-k of the activation); the flags and their refusals; (slow, multirank) EP2 x
DP2 training against the single-process reference, loss and global gradient norm each step."""
from types import SimpleNamespace
from unittest import mock

import pytest
import torch
import torch.nn.functional as F

from megatron_zero.arguments import parse_args
from megatron_zero.model.gpt import reference_model
from megatron_zero.moe.router import route
from megatron_zero.moe.sinkhorn import sinkhorn
from megatron_zero.testing import run_ranks
from megatron_zero.testing.flag_checks import BASE, refused, with_flags
from megatron_zero.testing.moe_train import GBS, moe_config, parallel_run, reference_run
from megatron_zero.testing.tolerances import assert_losses_close, global_norm_rtol, gpt_path_length, model_rtol

router_module = pytest.importorskip("megatron.core.transformer.moe.router")
moe_utils = pytest.importorskip("megatron.core.transformer.moe.moe_utils")

S, B, H, E = 16, 2, 32, 8
TOL = 1e-6


def megatron_core_router(topk):
    """TopKRouter on the CPU: its gate asks for the current CUDA device and Transformer Engine's GEMM (absent:
    torch.mm) in forward and backward, both answered within `_on_cpu()` only."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    cfg = TransformerConfig(num_layers=1, hidden_size=H, num_attention_heads=4, num_moe_experts=E, moe_router_topk=topk,
                            moe_router_load_balancing_type="sinkhorn", moe_aux_loss_coeff=0.0, add_bias_linear=False,
                            moe_router_dtype="fp32", moe_ffn_hidden_size=H)
    groups = SimpleNamespace(tp=None, cp=None, tp_cp=None, tp_dp_cp=None)
    return router_module.TopKRouter(cfg, pg_collection=groups)


def _on_cpu():
    return (mock.patch("torch.cuda.current_device", lambda: "cpu"),
            mock.patch.object(moe_utils, "te_general_gemm", None, create=True))


def test_sinkhorn_is_megatron_cores():
    cost = torch.randn(S * B, E, generator=torch.Generator().manual_seed(1))
    assert torch.equal(sinkhorn(cost), moe_utils.sinkhorn(cost))


@pytest.mark.parametrize("topk", [1, 2, 4])
@pytest.mark.parametrize("training", [True, False], ids=["training", "evaluation"])
def test_sinkhorn_router_matches_megatron_core(topk, training):
    cuda_device, te_gemm = _on_cpu()
    with cuda_device, te_gemm:
        mc = megatron_core_router(topk)
        g = torch.Generator().manual_seed(10 * topk)
        with torch.no_grad():
            mc.weight.copy_(torch.randn(E, H, generator=g))
        mc.train(training)
        x = torch.randn(S, B, H, generator=g, requires_grad=True)
        probs, routing_map = mc(x)
        r = torch.randn(S * B, E, generator=g)  # a downstream use of the weights, for their gradients
        want = torch.autograd.grad((probs * r).sum(), [x, mc.weight])

    weight = mc.weight.detach().clone().requires_grad_()
    ours_x = x.detach().transpose(0, 1).contiguous().requires_grad_()  # [b, s, h]
    logits = F.linear(ours_x.reshape(-1, H), weight).float()
    weights, ids = route(logits, topk, False, "sinkhorn", 0.0, None, batch=B, training=training)
    dense = torch.zeros(S * B, E).scatter(1, ids, weights)  # [b s, E]
    mc_order = dense.view(B, S, E).transpose(0, 1).reshape(S * B, E)  # Megatron-Core's [s b] rows
    assert torch.equal(mc_order != 0, routing_map)
    assert torch.allclose(mc_order, probs, rtol=0, atol=TOL)
    r_ours = r.view(S, B, E).transpose(0, 1).reshape(S * B, E)
    got = torch.autograd.grad((dense * r_ours).sum(), [ours_x, weight])
    assert torch.allclose(got[0].transpose(0, 1), want[0], rtol=0, atol=TOL)
    assert torch.allclose(got[1], want[1], rtol=0, atol=TOL)
    if training:  # the balanced choice is not the activation's top-k: the test tells the two apart
        plain = torch.topk(logits, topk, dim=1)[1]
        assert not torch.equal(torch.sort(plain, 1)[0], torch.sort(ids, 1)[0])


def test_sinkhorn_flag_parses():
    args = parse_args(with_flags(BASE, num_experts=4, moe_router_load_balancing_type="sinkhorn", moe_router_topk=1))
    assert args.moe_router_load_balancing_type == "sinkhorn"


@pytest.mark.parametrize("changes,message", [
    ({"moe_aux_loss_coeff": 0.01}, "--moe-aux-loss-coeff 0.01 does not apply"),
    ({"moe_router_score_function": "sigmoid"}, "--moe-router-score-function sigmoid does not apply"),
    ({"moe_router_pre_softmax": True}, "--moe-router-pre-softmax does not apply"),
    ({"moe_router_topk_scaling_factor": 2.0}, "--moe-router-topk-scaling-factor does not apply"),
])
def test_sinkhorn_flags_refused(changes, message, capsys):
    flags = with_flags(BASE, num_experts=4, moe_router_load_balancing_type="sinkhorn", **changes)
    assert message in refused(flags, 1, capsys)


@pytest.mark.multirank
@pytest.mark.slow  # the default tier: test_sinkhorn_router_matches_megatron_core, test_moe_parity's EP2 x DP2
@pytest.mark.parametrize("topk", [1, 2])
def test_sinkhorn_expert_parallel_matches_reference(topk):
    """EP2 x DP2 ZeRO-1 (GPT), z-loss on, each rank routing its own micro-batch as the reference does."""
    cfg = moe_config(False, moe_router_load_balancing_type="sinkhorn", moe_aux_loss_coeff=0.0, moe_router_topk=topk)
    dp, mb, steps = 2, 2, 4
    ref_losses, ref_norms = reference_run(cfg, dp, mb, steps)
    results = run_ranks(parallel_run, dp, cfg, 1, 1, 2, 1, mb, steps, timeout=600)
    rtol = model_rtol(gpt_path_length(cfg, GBS * cfg.seq_length))
    count = sum(p.numel() for p in reference_model(cfg).parameters())
    for losses, norms in results:
        assert_losses_close(losses, ref_losses, rtol, "sinkhorn loss")
        assert_losses_close(norms, ref_norms, global_norm_rtol(rtol, count), "sinkhorn grad norm")
