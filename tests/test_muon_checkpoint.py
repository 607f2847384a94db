"""Muon's checkpoints: the momentum in DeepSpeed's layout as Adam's first moment (`exp_avg`; the Muon group's
`exp_avg_sq` zeros, so DeepSpeed's own readers take the files), converted by tools/ds_to_universal.py, read by
zero_to_fp32.py, and a run resumed at another TP / PP / DP / ZeRO stage, from the universal checkpoint or the plain
one directly, continuing the loss within the Adam reshapes' bound (tests/test_universal_checkpoint.py: 1e-5).

Baseline: the tiny GPT at TP2 ZeRO-1, Muon (duplicated TP: its result does not depend on TP), saved at iteration
10 of 20."""
import os
import subprocess
import sys

import pytest
import torch

from megatron_zero.checkpoint.storage.tensor_io import load_file
from megatron_zero.testing import run_ranks
from megatron_zero.testing.layout_train import ITERS, SAVE_AT, check_resume, config, full_weights, train
from megatron_zero.testing.moe_reshape import SAVE_AT as MOE_SAVE_AT
from megatron_zero.testing.moe_reshape import moe_run
from megatron_zero.testing.moe_train import moe_config
from megatron_zero.testing.muon_train import settings

pytestmark = pytest.mark.multirank
MUON = settings(config(), "duplicated", extra_scale_factor=0.2)
BOUND = 1e-5  # the Adam reshapes' (tests/test_universal_checkpoint.py)


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    root = tmp_path_factory.mktemp("muon_universal")
    results = run_ranks(train, 2, 2, 1, 1, 2, str(root), muon=MUON, timeout=300)
    losses = results[0][1]
    assert losses[ITERS - 1] < losses[0] - 0.1, "the baseline must actually learn for the test to mean anything"
    src = os.path.join(root, f"global_step{SAVE_AT}")
    out = os.path.join(root, f"global_step{SAVE_AT}_universal")
    tool = [sys.executable, os.path.join(os.path.dirname(__file__), "..", "tools", "ds_to_universal.py"),
            "--input_folder", src, "--output_folder", out]
    run = subprocess.run(tool, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    return {"losses": losses, "weights": full_weights(results), "src": src, "universal": out, "root": str(root)}


def test_momentum_is_saved_as_exp_avg_and_converted(baseline):
    optim = load_file(os.path.join(baseline["src"], "zero_pp_rank_0_mp_rank_00_optim_states.pt"))
    state = optim["optimizer_state_dict"]["base_optimizer_state"]
    assert state["param_groups"][0]["muon"] is True and "muon" not in state["param_groups"][1]
    assert state["state"][0]["exp_avg"].abs().sum() > 0 and state["state"][0]["exp_avg_sq"].abs().sum() == 0
    assert state["state"][1]["exp_avg_sq"].abs().sum() > 0  # AdamW's groups keep both moments
    momentum = load_file(os.path.join(baseline["universal"], "zero", "2.self_attention.dense.weight", "exp_avg.pt"))
    assert momentum["param"].shape == (32, 32) and momentum["cat_dim"] == 1 and momentum["param"].abs().sum() > 0


def test_zero_to_fp32_reads_a_muon_checkpoint(baseline, tmp_path):
    out = str(tmp_path / "full.pt")
    script = os.path.join(baseline["src"], "zero_to_fp32.py")
    run = subprocess.run([sys.executable, script, baseline["root"], out, "--tag", f"global_step{SAVE_AT}"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    got = torch.load(out)
    universal = os.path.join(baseline["universal"], "zero", "3.mlp.dense_h_to_4h.weight", "fp32.pt")
    torch.testing.assert_close(got["3.mlp.dense_h_to_4h.weight"], load_file(universal)["param"], rtol=0, atol=0)


LAYOUTS = {  # name: (tp, pp, dp, zero stage, micro-batch, which checkpoint)
    "a-same-plain": (2, 1, 1, 1, 2, "plain"),
    "b-tp1-pp2-dp2": (1, 2, 2, 1, 2, "universal"),
    "c-tp4": (4, 1, 1, 1, 1, "universal"),
    "d-dp4-zero2": (1, 1, 4, 2, 2, "universal"),
    "e-dp2-zero3-direct": (1, 1, 2, 3, 1, "plain"),
    "f-tp2-pp2-dp2-direct": (2, 2, 2, 1, 1, "plain"),
    "g-pp4": (1, 4, 1, 1, 1, "universal"),
}
DEFAULT_TIER = {"e-dp2-zero3-direct"}  # 2 ranks; the others (4 to 8 ranks, 15-40 s each) in the slow tier


@pytest.mark.parametrize("name", [n if n in DEFAULT_TIER else pytest.param(n, marks=pytest.mark.slow)
                                  for n in LAYOUTS])
def test_muon_resumes_reshaped(baseline, name):
    tp, pp, dp, stage, mb, kind = LAYOUTS[name]
    source = baseline["universal"] if kind == "universal" else baseline["src"]
    results = run_ranks(train, tp * pp * dp, tp, pp, stage, mb, None, source,
                        "universal" if kind == "universal" else "reshaped", muon=MUON, timeout=300)
    check_resume(baseline, results, BOUND)


@pytest.mark.slow  # 2 x 2 ranks, ~25 s; in the default tier e-dp2-zero3-direct (reshaped momentum) and
# tests/test_muon_parity.py's EP2 MoE (experts' ownership) cover it
def test_muon_moe_resumes_at_another_expert_parallel_size(tmp_path):
    """An MoE Muon run (every expert its own matrix) at EP2 x DP2 ZeRO-1 saved at step 5 of 10, resumed from the
    plain checkpoint directly at EP1 (the experts regrouped by the reshaping loader): steps 5-9 as the baseline's."""
    cfg = moe_config(True)
    muon = settings(cfg, "duplicated")
    save = str(tmp_path / "moe")
    baseline = run_ranks(moe_run, 2, cfg, 1, 1, 2, 1, 1, save, muon=muon, timeout=300)[0][0]
    resumed = run_ranks(moe_run, 2, cfg, 1, 1, 1, 1, 1, None, os.path.join(save, f"global_step{MOE_SAVE_AT}"),
                        "reshaped", muon=muon, timeout=300)
    for losses, _, _ in resumed:
        assert sorted(losses) == list(range(MOE_SAVE_AT, len(baseline)))
        for step, loss in losses.items():
            assert abs(loss - baseline[step]) <= BOUND * abs(baseline[step]), (step, loss, baseline[step])


@pytest.mark.slow  # DeepSpeed's converter in a subprocess, ~20 s; the default tier converts with tools/ds_to_universal.py
def test_deepspeed_converts_a_muon_checkpoint_as_ours_does(baseline, tmp_path):
    """DeepSpeed 0.19's own ds_to_universal reads the momentum as Adam's first moment: the same universal files
    (the Muon matrices' exp_avg their momentum, exp_avg_sq zeros) as tools/ds_to_universal.py writes."""
    pytest.importorskip("deepspeed", reason="deepspeed is not installed; CI installs it")
    theirs = str(tmp_path / "theirs")
    cmd = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", baseline["src"],
           "--output_folder", theirs, "--num_extract_workers", "1", "--num_merge_workers", "1"]
    run = subprocess.run(cmd, env={**os.environ, "DS_ACCELERATOR": "cpu"}, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    for name in ("2.self_attention.query_key_value.weight", "3.mlp.dense_4h_to_h.weight", "2.input_layernorm.weight"):
        for key in ("fp32", "exp_avg", "exp_avg_sq"):
            ours = load_file(os.path.join(baseline["universal"], "zero", name, f"{key}.pt"))
            got = load_file(os.path.join(theirs, "zero", name, f"{key}.pt"))
            assert torch.equal(got["param"], ours["param"]) and got.get("cat_dim") == ours.get("cat_dim"), (name, key)
