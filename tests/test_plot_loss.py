"""tools/plot_loss.py as a person runs it: TensorBoard directories in, a PNG of their loss curves out (the
resumed run's start marked), as scripts/demo.sh draws its two runs; without matplotlib one sentence saying
how to install it. The default tier's directories are written by the trainer's own writer (logger.ScalarLog,
Megatron's tags); the slow test draws a pretrain_gpt.py run and its resume."""
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from megatron_zero.metrics.logger import ScalarLog
from megatron_zero.testing.launch import ROOT, byte_data, pretrain

TOOL = os.path.join(ROOT, "tools", "plot_loss.py")
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _tool(*argv, python=(sys.executable,)):
    return subprocess.run([*python, TOOL, *map(str, argv)], capture_output=True, text=True, timeout=180)


def _write_run(directory, iterations, validation=()):
    log = ScalarLog(SimpleNamespace(tensorboard_dir=str(directory), wandb_project=None), 100, True)
    for it in iterations:
        log.scalar("lm loss", 6.0 / (1 + 0.05 * it), it, 16 * it)
    for it in validation:
        log.scalar("lm loss validation", 6.2 / (1 + 0.05 * it), it, 16 * it)
    log.close()


def _colours(png):
    """The share of the image's pixels in each of the first two line colours (matplotlib's C0, C1)."""
    import numpy as np
    from matplotlib.image import imread

    pixels = (imread(png)[..., :3] * 255).round().astype(int)
    found = {}
    for name, rgb in (("C0", (0x1F, 0x77, 0xB4)), ("C1", (0xFF, 0x7F, 0x0E))):
        found[name] = float((np.abs(pixels - np.array(rgb)).sum(-1) < 30).mean())
    return pixels.shape, found


def test_two_runs_one_resumed_make_one_png(tmp_path):
    pytest.importorskip("matplotlib")
    _write_run(tmp_path / "tp2_pp2", range(1, 31), validation=(10, 20, 30))
    _write_run(tmp_path / "tp1_dp4", range(31, 51), validation=(40, 50))
    out = tmp_path / "loss.png"
    run = _tool(tmp_path / "tp2_pp2", tmp_path / "tp1_dp4", "--labels", "TP2 x PP2", "TP1 x DP4", "--output", out)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == f"wrote {out}: the lm loss of TP2 x PP2; TP1 x DP4"
    assert out.read_bytes()[:8] == PNG_SIGNATURE
    shape, colours = _colours(out)
    assert min(shape[:2]) >= 400 and colours["C0"] > 0.001 and colours["C1"] > 0.001, (shape, colours)


def test_refusals_are_one_sentence(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    run = _tool(empty)
    assert run.returncode == 2 and run.stderr.strip() == (
        f"plot_loss.py: error: {empty} holds no 'lm loss' scalars: is it a run's --tensorboard-dir?")
    _write_run(tmp_path / "a", range(1, 3))
    run = _tool(tmp_path / "a", "--labels", "x", "y")
    assert run.returncode == 2 and "--labels gives 2 names for 1 run directories" in run.stderr
    hidden = ("-c", "import runpy, sys; sys.modules['matplotlib'] = None; sys.argv = sys.argv[1:]; "
                    "runpy.run_path(sys.argv[0], run_name='__main__')")
    run = _tool(tmp_path / "a", python=(sys.executable, *hidden))
    assert run.returncode == 2 and run.stderr.strip() == (
        "plot_loss.py: error: drawing needs matplotlib, which is not installed (pip install matplotlib, or pip "
        "install 'megatron_zero[plot]')"), run.stderr


@pytest.mark.slow  # test_two_runs_one_resumed_make_one_png draws directories of the trainer's own writer
def test_a_run_and_its_resume_drawn(tmp_path):
    pytest.importorskip("matplotlib")
    data = byte_data(tmp_path / "bytes")
    first = pretrain(tmp_path, data, **{"train-iters": 4, "tensorboard-dir": tmp_path / "tb1"})
    assert first.returncode == 0, first.stderr[-2000:]
    second = pretrain(tmp_path, data, **{"train-iters": 8, "load": tmp_path / "ckpt", "tensorboard-dir": tmp_path / "tb2",
                                        "override-opt_param-scheduler": True})
    assert second.returncode == 0, second.stderr[-2000:]
    run = _tool(tmp_path / "tb1", tmp_path / "tb2", "--output", tmp_path / "loss.png")
    assert run.returncode == 0 and (tmp_path / "loss.png").read_bytes()[:8] == PNG_SIGNATURE, run.stderr
    _, colours = _colours(tmp_path / "loss.png")
    assert colours["C0"] > 0.0005 and colours["C1"] > 0.0005, colours
