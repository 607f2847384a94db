"""MoE with expert parallelism against the single-process reference (fp32, dropless, aux and z losses on,
clipping active): each step's loss and global gradient norm to model_rtol of one step's path
(megatron_zero/testing/tolerances.py) at EP2 x DP2, EP2 x DP4 (expert-DP 2), EP2 x TP2, EP2 x PP2, EP4 x DP4,
and EP2 on ZeRO 1 and 2, GPT (GeLU experts) and Llama (SwiGLU experts, MoE every other layer)."""
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
