"""FP8 checkpoints through the command line: an FP8 run (Llama, TP2, emulated FP8 on the CPU, tensorwise
scaling) saves the files a run without FP8 saves; it resumes as saved bit-identically (tensorwise keeps no
scaling state: every scale is recomputed from its tensor, so the restored weights, moments, schedule and data
position are the whole state); tools/ds_to_universal.py converts it and the universal resume at the same layout is bit-identical
too, and at ZeRO-2 the first resumed iteration's loss (the restored weights' forward) is within
test_cli_resume's 1e-5. Later iterations at another layout are not compared: Adam turns the reordered
gradient sums into weight differences on near-zero-gradient elements, and an FP8 rounding of such a weight
can move by a whole FP8 spacing (2^-3 relative); the measured drift is ~1e-5 after one step, and no bound
for it is derived here. It resumes without FP8, and a checkpoint saved without FP8 resumes with it.
With delayed scaling (Megatron-LM's default recipe) the amax histories are training state: the run resumed as
saved is bit-identical (they are in the model-states files), and a universal resume says in one line that
they start fresh. With --fp8-param-gather (delayed scaling, DP2, ZeRO-1 with the overlapped gather, ZeRO-3) the run resumed as saved is
bit-identical too: the resume casts the FP8 weights again from the restored masters with the restored scales.
The default tier's FP8 checkpoint claim is
tests/test_fp8_checkpoint.py (the converted model's state is the unconverted one's)."""
import os

import pytest

from megatron_zero.testing.cli import CliResume, cli_flags, layout_flags, logged_losses, pretrain_cli, text_data

pytestmark = [pytest.mark.multirank, pytest.mark.slow]
pytest.importorskip("torchao.float8")
FP8 = {"fp8-format": "hybrid", "fp8-recipe": "tensorwise", "fp8-emulate": True}
NO_FP8 = {"fp8-format": None, "fp8-recipe": None, "fp8-emulate": None}
DELAYED = {"fp8-format": "hybrid", "fp8-emulate": True, "fp8-amax-history-len": 4, "fp8-amax-compute-algo": "max"}
GATHER = {**DELAYED, "fp8-param-gather": True, "overlap-param-gather": True}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8_resume")
    data = text_data(root / "text")
    made = {}
    for name, fp8 in (("fp8", FP8), ("plain", NO_FP8), ("delayed", DELAYED)):
        os.makedirs(root / name)
        made[name] = CliResume(str(root / name), lambda *c, fp8=fp8: cli_flags(data, str(root / "cache"), "llama",
                                                                              fp8, *c), layout_flags(tp=2))
    for name, zero in (("gather", 1), ("gather_zero3", 3)):  # DP2
        os.makedirs(root / name, exist_ok=True)
        made[name] = CliResume(str(root / name), lambda *c: cli_flags(data, str(root / "cache"), "llama", GATHER, *c),
                               layout_flags(zero=zero))
    made["flags"] = lambda *c: cli_flags(data, str(root / "cache"), "llama", *c)
    return made


def test_fp8_saves_what_a_run_without_fp8_saves(runs):
    fp8, plain = runs["fp8"], runs["plain"]
    assert "FP8 (hybrid, tensorwise scaling, emulated): 8 linear layers" in fp8.stdout
    assert sorted(os.listdir(fp8.checkpoint)) == sorted(os.listdir(plain.checkpoint))
    assert fp8.losses != plain.losses  # the GEMMs ran in FP8


def test_fp8_resumes_as_saved_and_universal(runs):
    fp8 = runs["fp8"]
    fp8.assert_matches(fp8.resume("as saved"), 0.0)
    fp8.assert_matches(fp8.resume("universal"), 0.0)
    first = fp8.save_at + 1
    resumed = fp8.resume("universal", layout_flags(zero=2))
    assert sorted(resumed) == list(range(first, fp8.iters + 1))
    assert abs(resumed[first] - fp8.losses[first]) <= 1e-5 * fp8.losses[first], (resumed, fp8.losses)


@pytest.mark.parametrize("saved, resumed", [("fp8", NO_FP8), ("plain", FP8)])
def test_resume_across_fp8_and_not(runs, saved, resumed):
    ckpt = runs[saved]
    run = pretrain_cli(2, runs["flags"]({"train-iters": ckpt.iters}, layout_flags(tp=2), resumed,
                                        {"load": ckpt.checkpoint}))
    losses = logged_losses(run)
    assert sorted(losses) == list(range(ckpt.save_at + 1, ckpt.iters + 1)), run.stdout[-2000:]
    assert ("FP8 (hybrid" in run.stdout) == (resumed is FP8)
    first = ckpt.losses[ckpt.save_at + 1]  # the saved run's next loss: the resumed one is its FP8 (or not) twin
    assert abs(losses[ckpt.save_at + 1] - first) < abs(first - ckpt.losses[1])  # not a fresh start


def test_delayed_scaling_histories_resume_bit_exactly(runs):
    delayed = runs["delayed"]
    assert "FP8 (hybrid, delayed scaling, amax history 4 (max), emulated): 8 linear layers" in delayed.stdout
    delayed.assert_matches(delayed.resume("as saved"), 0.0)
    universal = delayed.resume_run("universal")
    assert "FP8 delayed scaling: the amax histories start fresh (scale 1), a universal checkpoint keeps none" \
        in universal.stdout, universal.stdout[-2000:]


@pytest.mark.parametrize("name", ["gather", "gather_zero3"])
def test_fp8_param_gather_resumes_bit_exactly(runs, name):
    gather = runs[name]
    assert "; ZeRO all-gathers their weights in FP8" in gather.stdout, gather.stdout[-2000:]
    gather.assert_matches(gather.resume("as saved"), 0.0)
