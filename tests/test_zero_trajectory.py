"""ZeRO stage 0/1/2/3 on DP 2 and 4 follows torch.optim.AdamW on one process, to relative 1e-5 per step.
Stage 3 runs with persistence threshold 100 (small parameters stay gathered) on DP 2 and 0 (every
parameter in a unit gathered per unit) on DP 4."""
import pytest

from megatron_zero.testing import run_ranks
from megatron_zero.testing.toy_zero import reference, rel, zero_run

STAGES = (0, 1, 2, 3)


def run_stages(clip, persist):
    return {stage: zero_run(stage, clip=clip, persistence_threshold=persist) for stage in STAGES}


@pytest.mark.parametrize("dp,clip,persist", [(2, 0.0, 100), (4, 0.3, 0)])
def test_zero_matches_adamw(dp, clip, persist):
    ref_losses, ref_weights = reference(clip=clip)
    results = run_ranks(run_stages, dp, clip, persist, timeout=240)
    for stage in STAGES:
        runs = [r[stage] for r in results]
        assert all(r["losses"] == runs[0]["losses"] for r in runs), "ranks disagree on the loss"
        for step, (got, want) in enumerate(zip(runs[0]["losses"], ref_losses)):
            assert abs(got - want) <= 1e-5 * abs(want), (stage, step, got, want)
        assert all(runs[0]["updated"])
        if clip:  # clipping must actually have been active for this case to mean anything
            assert max(runs[0]["norms"]) > clip, runs[0]["norms"]
        for name, want in ref_weights.items():
            assert rel(runs[0]["weights"][name], want) <= 1e-5, (stage, name)
