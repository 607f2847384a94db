"""MoE with expert parallelism against the single-process reference (fp32, dropless, aux and z losses on,
clipping active): each step's loss and global gradient norm to model_rtol of one step's path
(megatron_zero/testing/tolerances.py) at EP2 x DP2, EP2 x DP4 (expert-DP 2), EP2 x TP2, EP2 x PP2, EP4 x DP4,
and EP2 on ZeRO 1 and 2, GPT (GeLU experts) and Llama (SwiGLU experts, MoE every other layer). Then
DeepSpeed-MoE's capacity gating with tokens dropped at EP2 x DP2: top-1 on ZeRO 0 and top-2 on ZeRO 1; and
Megatron-Core's capacity (probs at EP2 x DP2; position with seq_aux_loss and the sigmoid router at EP2 x TP2)."""
import pytest

from megatron_zero.model.gpt import reference_model
from megatron_zero.testing import run_ranks
from megatron_zero.testing.moe_train import GBS, moe_config, parallel_run, reference_run
from megatron_zero.testing.tolerances import assert_losses_close, global_norm_rtol, gpt_path_length, model_rtol

pytestmark = pytest.mark.multirank

SLOW = pytest.mark.slow
LAYOUTS = {  # name: (tp, pp, dp, ep, zero stage, micro-batch, llama)
    "ep2_dp2_zero1": (1, 1, 2, 2, 1, 2, False),
    "ep2_dp4_zero1": (1, 1, 4, 2, 1, 2, False),
    "ep2_dp4_zero2_llama": (1, 1, 4, 2, 2, 2, True),
    "ep2_tp2_zero1": (2, 1, 2, 2, 1, 2, False),
    "ep2_pp2_zero2_llama": (1, 2, 2, 2, 2, 1, True),
    "ep4_dp4_zero1": (1, 1, 4, 4, 1, 1, False),
}
DEFAULT_TIER = {"ep2_dp2_zero1"}  # each of the others runs > 30 s on 4 ranks


@pytest.mark.parametrize("name", [n if n in DEFAULT_TIER else pytest.param(n, marks=SLOW) for n in LAYOUTS])
def test_moe_expert_parallel_matches_reference(name):
    tp, pp, dp, ep, stage, mb, llama = LAYOUTS[name]
    cfg = moe_config(llama)
    ref_losses, ref_norms = reference_run(cfg, dp, mb)
    results = run_ranks(parallel_run, tp * pp * dp, cfg, tp, pp, ep, stage, mb, timeout=600)
    rtol = model_rtol(gpt_path_length(cfg, GBS * cfg.seq_length))
    count = sum(p.numel() for p in reference_model(cfg).parameters())  # the squares the global norm sums
    for losses, norms in results:
        assert_losses_close(losses, ref_losses, rtol, f"{name} loss")
        assert_losses_close(norms, ref_norms, global_norm_rtol(rtol, count), f"{name} grad norm")


# DeepSpeed-MoE's capacity gating (dropping active: capacity 4 of a micro-batch's 16 tokens per expert at
# top-1, 8 at top-2), random token selection off so that the reference draws nothing
CAPACITY = dict(moe_z_loss_coeff=None, moe_capacity_factor=1.0, moe_min_capacity=0, moe_use_rts=False,
                moe_top2_2nd_expert_sampling=False)
CAPACITY_LAYOUTS = {  # name: (zero stage, top-k)
    "capacity_top1_ep2_dp2_zero0": (0, 1),  # the layout of ds_pretrain_gpt_125M_MoE64.sh
    "capacity_top2_ep2_dp2_zero1": (1, 2),
}
CAPACITY_STEPS = 5


@pytest.mark.parametrize("name", [n if "top1" in n else pytest.param(n, marks=SLOW) for n in CAPACITY_LAYOUTS])
def test_moe_capacity_gating_expert_parallel_matches_reference(name):
    stage, k = CAPACITY_LAYOUTS[name]
    tp, pp, dp, ep, mb = 1, 1, 2, 2, 2
    cfg = moe_config(False, moe_router_topk=k, **CAPACITY)
    ref_losses, ref_norms = reference_run(cfg, dp, mb, CAPACITY_STEPS)
    roomy = reference_run(moe_config(False, moe_router_topk=k, **{**CAPACITY, "moe_capacity_factor": 8.0}), dp, mb,
                          CAPACITY_STEPS)
    assert roomy[0] != ref_losses, "no token was dropped: the test does not exercise capacity"
    results = run_ranks(parallel_run, tp * pp * dp, cfg, tp, pp, ep, stage, mb, CAPACITY_STEPS, timeout=600)
    rtol = model_rtol(gpt_path_length(cfg, GBS * cfg.seq_length))
    count = sum(p.numel() for p in reference_model(cfg).parameters())
    for losses, norms in results:
        assert_losses_close(losses, ref_losses, rtol, f"{name} loss")
        assert_losses_close(norms, ref_norms, global_norm_rtol(rtol, count), f"{name} grad norm")


def test_moe_random_token_selection_agrees_over_tensor_parallel_ranks():
    """Random token selection on: both TP ranks of a TP2 run draw what the reference draws (the default
    generator, seeded alike), so they keep the same tokens and the run matches the reference."""
    cfg = moe_config(False, moe_router_topk=1, **{**CAPACITY, "moe_use_rts": True})
    ref_losses, ref_norms = reference_run(cfg, 1, 2, CAPACITY_STEPS, seed=5)
    results = run_ranks(parallel_run, 2, cfg, 2, 1, 1, 1, 2, CAPACITY_STEPS, seed=5, timeout=600)
    rtol = model_rtol(gpt_path_length(cfg, GBS * cfg.seq_length))
    count = sum(p.numel() for p in reference_model(cfg).parameters())
    for losses, norms in results:
        assert_losses_close(losses, ref_losses, rtol, "tp2 rts loss")
        assert_losses_close(norms, ref_norms, global_norm_rtol(rtol, count), "tp2 rts grad norm")


# Megatron-Core's capacity (tokens dropped: capacity ceil(16 x 2 / 4 x 0.5) = 4 of a micro-batch's 16 tokens per
# expert), each rank dropping among its own tokens as the reference fed its micro-batches does
CORE_CAPACITY = {  # name: (tp, dp, ep, zero stage, config overrides)
    "core_capacity_probs_ep2_dp2_zero1": (1, 2, 2, 1, dict(moe_expert_capacity_factor=0.5)),
    "core_capacity_position_seq_aux_sigmoid_ep2_tp2": (2, 2, 2, 2, dict(
        moe_expert_capacity_factor=0.5, moe_token_drop_policy="position", moe_router_load_balancing_type="seq_aux_loss",
        moe_router_score_function="sigmoid", moe_router_topk_scaling_factor=2.0)),
}


@pytest.mark.parametrize("name", [n if "probs" in n else pytest.param(n, marks=SLOW) for n in CORE_CAPACITY])
def test_moe_core_capacity_matches_reference(name):
    tp, dp, ep, stage, overrides = CORE_CAPACITY[name]
    mb = 2
    cfg = moe_config(False, **overrides)
    ref_losses, ref_norms = reference_run(cfg, dp, mb, CAPACITY_STEPS)
    dropless = {k: v for k, v in overrides.items() if k not in ("moe_expert_capacity_factor", "moe_token_drop_policy")}
    roomy = reference_run(moe_config(False, **dropless), dp, mb, CAPACITY_STEPS)
    assert roomy[0] != ref_losses, "no token was dropped: the test does not exercise capacity"
    results = run_ranks(parallel_run, tp * dp, cfg, tp, 1, ep, stage, mb, CAPACITY_STEPS, timeout=600)
    rtol = model_rtol(gpt_path_length(cfg, GBS * cfg.seq_length))
    count = sum(p.numel() for p in reference_model(cfg).parameters())
    for losses, norms in results:
        assert_losses_close(losses, ref_losses, rtol, f"{name} loss")
        assert_losses_close(norms, ref_norms, global_norm_rtol(rtol, count), f"{name} grad norm")
