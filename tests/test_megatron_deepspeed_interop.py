"""Checkpoints between Megatron-DeepSpeed itself and ours, both ways, driven as users run them.

Megatron-DeepSpeed's pretrain_gpt.py runs the way bench/bench_vs_megatron_deepspeed.py runs it (same model, data,
CPU flags, DeepSpeed JSON), at DP 2 with ZeRO-1 (--no-pipeline-parallel), TP 2 (--no-pipeline-parallel, ZeRO
stage 0) and PP 2 (its pipeline engine, ZeRO stage 0); ours at the same layout. Every run trains toward
iteration 7 with the same schedule, --weight-decay 0 (Megatron-DeepSpeed on a CPU without apex steps torch's
Adam, whose weight decay is L2, ours AdamW's decoupled one: equal only without weight decay) and no gradient
clipping (its pipeline engine without ZeRO counts the tied embedding's gradient once per stage holding it in the
global norm, ours once: the clipped steps differ by design):
  MDS -> ours   MDS saves at iteration 6 (--exit-interval 6); MDS resumes it for iteration 7, and so does ours
                (--load of MDS's directory): the iteration-7 losses agree (same weights, same batch) and so do
                the weights after that step; ours at another layout (--load, reshaped while loading; and for
                DP 2 through tools/ds_to_universal.py and --universal-checkpoint) gives the same loss;
  ours -> MDS   ours saves at 6 with --save-megatron-deepspeed-layout; ours and MDS each resume it for
                iteration 7: same loss, same weights after the step.
Tolerances: losses 1e-5 (both print 7 significant digits; the forward passes agree to fp32 roundoff), weights
1e-5 absolute (one Adam step of lr 8e-4 from equal states: roundoff in the gradients moves an update by far
less). Needs Megatron-DeepSpeed set up by bench/peers/setup_megatron_deepspeed.sh: MDS_DIR (its tree),
MDS_PYTHON (its venv's python) and TORCH_EXTENSIONS_DIR (its built shm op); skipped, saying so, without them.
The same readers and writers are checked from the format alone in tests/test_megatron_deepspeed_checkpoint.py.
"""
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from megatron_zero.checkpoint.reshape.universal_source import SourceCheckpoint

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MDS_DIR, MDS_PYTHON = os.environ.get("MDS_DIR", ""), os.environ.get("MDS_PYTHON", "")
EXT_DIR = os.environ.get("TORCH_EXTENSIONS_DIR", "")
SCHEDULE = ["--lr-warmup-iters", "2", "--lr-decay-iters", "20", "--min-lr", "1e-4", "--weight-decay", "0",
            "--clip-grad", "0"]
OTHER_LAYOUT = {"dp2": "tp2", "tp2": "pp2", "pp2": "dp2"}
LOSS_AT_7 = re.compile(r"iteration\s+7/\s*7 \|.*?lm loss: ([0-9.E+-]+)")

pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    not (os.path.isfile(os.path.join(MDS_DIR, "pretrain_gpt.py")) and os.access(MDS_PYTHON, os.X_OK) and EXT_DIR),
    reason="Megatron-DeepSpeed is not set up: run bench/peers/setup_megatron_deepspeed.sh and set MDS_DIR, "
           "MDS_PYTHON and TORCH_EXTENSIONS_DIR")]


def _bench():
    spec = importlib.util.spec_from_file_location("bench_vs_mds", os.path.join(ROOT, "bench",
                                                                             "bench_vs_megatron_deepspeed.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    b = _bench()
    work = str(tmp_path_factory.mktemp("mds_data"))
    return b, b.build_data(work)


def _run(bench, side, layout, work, extra):
    b, data = bench
    if side == "mds":
        cmd, cwd = b.mds_cmd(layout, data, 7, MDS_DIR, MDS_PYTHON, work, extra=extra)
        config = os.path.join(work, f"ds_{layout}.json")  # DeepSpeed clips by its JSON, not --clip-grad
        with open(config) as f:
            ds = json.load(f)
        with open(config, "w") as f:
            json.dump({**ds, "gradient_clipping": 0.0}, f)
    else:
        cmd, cwd = b.ours_cmd(layout, data, 7, extra=extra)
    tp, pp, dp = b.LAYOUTS[layout]
    try:
        p = subprocess.run(cmd, cwd=cwd, env=b.launch_env(cwd, tp * pp * dp, EXT_DIR), capture_output=True,
                           text=True, timeout=900)
    finally:
        b.remove_shm_buffers(cmd)
    out = p.stdout + p.stderr
    assert p.returncode == 0, f"{side} {layout} failed:\n{out[-4000:]}"
    return out


def _loss_at_7(out):
    found = LOSS_AT_7.findall(out)
    assert found, out[-3000:]
    return float(found[-1])


def _max_weight_difference(a_dir, b_dir):
    a, b = SourceCheckpoint(a_dir, verify=False), SourceCheckpoint(b_dir, verify=False)
    assert sorted(n for n, _ in a.params) == sorted(n for n, _ in b.params)
    stage_b = dict(b.params)
    worst = 0.0
    for name, s in a.params:
        with a.stage(s) as ra, b.stage(stage_b[name]) as rb:
            worst = max(worst, (ra.assemble(name, "fp32")[0] - rb.assemble(name, "fp32")[0]).abs().max().item())
    return worst


@pytest.mark.parametrize("layout", ["dp2", "tp2", "pp2"])
def test_megatron_deepspeed_to_ours(bench, tmp_path, layout):
    a, a_mds, b = str(tmp_path / "mds_save"), str(tmp_path / "mds_resumed"), str(tmp_path / "ours")
    _run(bench, "mds", layout, str(tmp_path), ["--save", a, "--save-interval", "100", "--exit-interval", "6",
                                               *SCHEDULE])
    shutil.copytree(a, a_mds)
    mds = _loss_at_7(_run(bench, "mds", layout, str(tmp_path), ["--load", a_mds, "--save", a_mds,
                                                                "--save-interval", "100", *SCHEDULE]))
    ours = _loss_at_7(_run(bench, "ours", layout, str(tmp_path), ["--load", a, "--save", b,
                                                                  "--save-interval", "100", *SCHEDULE]))
    assert abs(ours - mds) <= 1e-5, (ours, mds)
    assert _max_weight_difference(os.path.join(a_mds, "global_step7"), os.path.join(b, "global_step7")) <= 1e-5
    # the same checkpoint, loaded directly at another layout (reshaped while loading): the same step-7 loss
    other = OTHER_LAYOUT[layout]
    reshaped = _loss_at_7(_run(bench, "ours", other, str(tmp_path), ["--load", a, *SCHEDULE]))
    assert abs(reshaped - mds) <= 1e-5, (other, reshaped, mds)
    if layout == "dp2":  # and through tools/ds_to_universal.py
        universal = str(tmp_path / "universal")
        subprocess.run([sys.executable, os.path.join(ROOT, "tools", "ds_to_universal.py"), "--input_folder",
                        os.path.join(a, "global_step6"), "--output_folder", universal], check=True,
                       capture_output=True)
        loss = _loss_at_7(_run(bench, "ours", other, str(tmp_path), ["--load", universal, "--universal-checkpoint",
                                                                     *SCHEDULE]))
        assert abs(loss - mds) <= 1e-5, (loss, mds)


@pytest.mark.parametrize("layout", ["dp2", "tp2", "pp2"])
def test_ours_to_megatron_deepspeed(bench, tmp_path, layout):
    c, c_mds = str(tmp_path / "ours_save"), str(tmp_path / "mds_resumed")
    flag = ["--save-megatron-deepspeed-layout", *SCHEDULE]
    _run(bench, "ours", layout, str(tmp_path), ["--save", c, "--save-interval", "100", "--exit-interval", "6", *flag])
    shutil.copytree(c, c_mds)
    ours = _loss_at_7(_run(bench, "ours", layout, str(tmp_path), ["--load", c, "--save", c, "--save-interval", "100",
                                                                  *flag]))
    mds = _loss_at_7(_run(bench, "mds", layout, str(tmp_path), ["--load", c_mds, "--save", c_mds,
                                                                "--save-interval", "100", *SCHEDULE]))
    assert abs(ours - mds) <= 1e-5, (ours, mds)
    assert _max_weight_difference(os.path.join(c, "global_step7"), os.path.join(c_mds, "global_step7")) <= 1e-5

