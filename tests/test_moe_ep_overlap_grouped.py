"""Expert parallelism with --overlap-grad-reduce / --overlap-param-gather (zero/expert_stage.py: expert
buckets reduce-scattered and gathered async over the expert-DP group, dense ones over DP) and with
--moe-grouped-gemm (moe/grouped_mlp.py), against the single-process reference (fp32, dropless, aux and
z losses on, clipping active; each step's loss and global gradient norm to model_rtol of one step's path,
megatron_zero/testing/tolerances.py) and, for overlap, against the same layout without it, to the same
tolerance (at DP 4 a reduce-scatter sums four numbers, whose order the collective may change between an
async and a blocking launch)."""
import pytest

from megatron_zero.model.gpt import reference_model
from megatron_zero.testing import run_ranks
from megatron_zero.testing.moe_train import GBS, moe_config, parallel_run, reference_run
from megatron_zero.testing.tolerances import assert_losses_close, global_norm_rtol, gpt_path_length, model_rtol

STEPS = 4
BUCKET = 1000  # elements: several buckets per group, so several collectives are in flight during backward


def _check(cfg, results, want, name):
    ref_losses, ref_norms = want
    rtol = model_rtol(gpt_path_length(cfg, GBS * cfg.seq_length))
    count = sum(p.numel() for p in reference_model(cfg).parameters())  # the squares the global norm sums
    for losses, norms in results:
        assert_losses_close(losses, ref_losses, rtol, f"{name} loss")
        assert_losses_close(norms, ref_norms, global_norm_rtol(rtol, count), f"{name} grad norm")


def _with_and_without_overlap(cfg, tp, pp, ep, stage, mb):
    return [parallel_run(cfg, tp, pp, ep, stage, mb, STEPS, overlap=overlap, bucket_size=BUCKET)
            for overlap in (False, True)]


@pytest.mark.parametrize("pp,stage,llama", [(1, 1, False), pytest.param(1, 0, False, marks=pytest.mark.slow),
                                             pytest.param(1, 2, True, marks=pytest.mark.slow),
                                             pytest.param(2, 2, True, marks=pytest.mark.slow)])
def test_overlap_with_expert_parallelism(pp, stage, llama):
    """EP2 x DP4 (expert-DP 2: the expert buckets have peers to reduce with and gather from; at ZeRO 0 they
    all-reduce), and EP2 x DP2 x PP2."""
    cfg = moe_config(llama)
    dp = 4 // pp
    results = run_ranks(_with_and_without_overlap, 4, cfg, 1, pp, 2, stage, 1, timeout=600)
    reference = reference_run(cfg, dp, 1, STEPS)
    for blocking, overlapped in results:
        _check(cfg, [overlapped], blocking, f"overlap pp{pp} zero{stage} against blocking")
    _check(cfg, [r[1] for r in results], reference, f"overlap pp{pp} zero{stage} against the reference")


@pytest.mark.parametrize("tp,dp,stage,llama", [(1, 2, 1, False), pytest.param(2, 2, 1, True, marks=pytest.mark.slow),
                                                pytest.param(1, 4, 3, False, marks=pytest.mark.slow)])
def test_grouped_gemm_with_expert_parallelism(tp, dp, stage, llama):
    """--moe-grouped-gemm at EP2 x DP2 (GPT: GeLU experts with biases), EP2 x TP2 (Llama: SwiGLU experts,
    column- and row-parallel slices), and at ZeRO-3 EP2 x DP4 (expert-DP 2: the experts gathered per layer into
    one storage, their biases read through the stacked view of it)."""
    cfg = moe_config(llama, moe_grouped_gemm=True)
    results = run_ranks(parallel_run, tp * dp, cfg, tp, 1, 2, stage, 2, STEPS, timeout=600)
    _check(cfg, results, reference_run(cfg, dp, 2, STEPS), f"grouped gemm tp{tp} zero{stage}")
