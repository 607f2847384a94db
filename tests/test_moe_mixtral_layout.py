"""The Mixtral-style layout: a Llama MoE (SwiGLU experts, RMSNorm, RoPE, grouped-query attention, MoE every
other layer) at EP2 x TP2 x PP2 (8 ranks, DP 2 = EP 2), alltoall dispatch, --moe-grouped-gemm, fp32, aux and
z losses on, against the single-process reference fed the same micro-batches: each step's loss and global
gradient norm to model_rtol of one step's path (megatron_zero/testing/tolerances.py). Dropless, and with
Megatron-Core's capacity (factor 0.5: each expert keeps 4 of a micro-batch's 16 tokens), where every rank drops
among its own micro-batch's tokens what the reference drops fed that micro-batch (a dropless reference differs,
so tokens are dropped)."""
import pytest

from megatron_zero.model.gpt import reference_model
from megatron_zero.testing import run_ranks
from megatron_zero.testing.moe_train import GBS, moe_config, parallel_run, reference_run
from megatron_zero.testing.tolerances import assert_losses_close, global_norm_rtol, gpt_path_length, model_rtol

pytestmark = [pytest.mark.multirank, pytest.mark.slow]

TP, PP, EP, DP, STAGE, MB, STEPS = 2, 2, 2, 2, 1, 2, 4


@pytest.mark.parametrize("capacity", [None, 0.5], ids=["dropless", "capacity"])
def test_mixtral_layout_matches_reference(capacity):
    cfg = moe_config(True, moe_grouped_gemm=True, moe_expert_capacity_factor=capacity)
    assert cfg.num_query_groups < cfg.num_attention_heads  # grouped-query attention
    ref_losses, ref_norms = reference_run(cfg, DP, MB, STEPS)
    if capacity is not None:
        dropless = reference_run(moe_config(True, moe_grouped_gemm=True), DP, MB, STEPS)
        assert dropless[0] != ref_losses, "no token was dropped: the test does not exercise capacity"
    results = run_ranks(parallel_run, TP * PP * DP, cfg, TP, PP, EP, STAGE, MB, STEPS, timeout=1800)
    rtol = model_rtol(gpt_path_length(cfg, GBS * cfg.seq_length))
    count = sum(p.numel() for p in reference_model(cfg).parameters())  # the squares the global norm sums
    worst = [(assert_losses_close(losses, ref_losses, rtol, "mixtral layout loss"),
              assert_losses_close(norms, ref_norms, global_norm_rtol(rtol, count), "mixtral layout grad norm"))
             for losses, norms in results]
    print(f"mixtral layout ({'dropless' if capacity is None else f'capacity {capacity}'}): loss and grad norm "
          f"within {max(w[0] for w in worst):.3g} and {max(w[1] for w in worst):.3g} of their bounds (rtol {rtol:.3g})")
