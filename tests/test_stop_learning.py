"""A run that has stopped learning stops, through pretrain_gpt.py as a user runs it (megatron_zero/training/stop_rules.py).

- fp16 whose loss scale cannot fall below what overflows (--initial-loss-scale = --min-loss-scale = 2**40: every
  step's gradients overflow) stops after --max-consecutive-skipped-iterations' default, 50, instead of training
  on: exit 2, one sentence naming the iterations, no checkpoint saved.
- fp32 on two ranks with a learning rate that blows the weights up at the first step (--lr 1e30): the next
  iteration's gradients are inf/NaN and --check-for-nan-in-loss-and-grad (on by default) stops it there, one
  sentence from one rank; the async save of iteration 1, in flight, is committed and named, and nothing of
  iteration 2 is saved.
- fp16 with the same learning rate: the loss turns NaN; under a dynamic loss scale the inf/NaN gradients are
  overflows, so the loss (read every --log-interval, and before each save) stops it, naming its iteration;
  no checkpoint is written at or after it, nor on the way out of a run that exits (--exit-interval) between
  two log lines. With --no-check-for-nan-in-loss-and-grad and
  --max-consecutive-skipped-iterations 0 the same run trains to its end, as it did before these rules.
"""
import os
import re
import subprocess
import sys

import pytest
from conftest import ROOT

from megatron_zero.testing.launch import PRETRAIN, byte_data, pretrain, tiny_flags
from megatron_zero.testing.multirank import free_port


def _error(run):
    """The one error line of a stopped run (exit 2, no traceback)."""
    out = run.stdout + run.stderr
    assert run.returncode == 2 and "Traceback" not in out, out[-3000:]
    errors = [line for line in out.splitlines() if "error:" in line]
    assert len(errors) == 1, out[-3000:]
    return errors[0]


def _saved(ckpt):
    return sorted(n for n in os.listdir(ckpt) if n.startswith("global_step")) if os.path.isdir(ckpt) else []


def test_fp16_whose_loss_scale_cannot_fall_far_enough_stops_after_50_skipped_steps(tmp_path):
    data, ckpt = byte_data(tmp_path / "bytes"), tmp_path / "ckpt"
    run = pretrain(tmp_path, data, fp16=True, **{"initial-loss-scale": 2.0 ** 40, "min-loss-scale": 2.0 ** 40,
                                                 "train-iters": 80, "log-interval": 10})
    assert _error(run) == (
        "pretrain_gpt.py: error: training stopped after iteration 50 because it has stopped learning: iterations 1 "
        "to 50 all skipped their optimizer step, their gradients overflowing (--max-consecutive-skipped-iterations "
        "50); no checkpoint was saved or loaded before it, and nothing after it was saved")
    assert "lm loss: " in run.stdout and _saved(ckpt) == []  # the losses were finite: only the steps failed


def test_inf_gradients_in_fp32_stop_at_their_iteration_and_the_async_save_before_is_committed(tmp_path):
    data, ckpt = byte_data(tmp_path / "bytes"), tmp_path / "ckpt"
    run = subprocess.run(  # two ranks (DP2): the sentence comes from one
        ["bash", os.path.join(ROOT, "scripts", "pretrain_torchrun.sh"), "--nproc_per_node", "2", "--master_addr",
         "127.0.0.1", "--master_port", str(free_port()), PRETRAIN]
        + tiny_flags(tmp_path, data, lr=1e30, **{"train-iters": 6, "save-interval": 1, "async-save": True}),
        capture_output=True, text=True, timeout=240, env={**os.environ, "OMP_NUM_THREADS": "1",
                                                          "PYTHON": sys.executable})
    assert _error(run) == (
        "pretrain_gpt.py: error: training stopped after iteration 2 because it has stopped learning: the gradients "
        "of iteration 2 hold inf or NaN (norm inf; --check-for-nan-in-loss-and-grad); the last checkpoint is "
        f"{ckpt / 'global_step1'}, and nothing after it was saved")
    assert _saved(ckpt) == ["global_step1"] and (ckpt / "latest").read_text() == "global_step1"
    assert "ChildFailedError" not in run.stdout + run.stderr


def test_a_nan_loss_in_fp16_stops_at_the_log_interval_naming_its_iteration(tmp_path):
    data, ckpt = byte_data(tmp_path / "bytes"), tmp_path / "ckpt"
    flags = {"lr": 1e30, "fp16": True, "train-iters": 12, "log-interval": 4, "save-interval": 6,
             "lr-warmup-iters": 0}
    run = pretrain(tmp_path, data, **flags)
    error = _error(run)
    found = re.fullmatch(r"pretrain_gpt\.py: error: training stopped after iteration (\d+) because it has stopped "
                         r"learning: the loss of iteration (\d+) is nan (?:\(read at iteration \1; )?\(?"
                         r"--check-for-nan-in-loss-and-grad\); (.*)", error)
    assert found, error
    stopped, bad = int(found.group(1)), int(found.group(2))
    assert bad <= stopped <= 6 and stopped in (4, 6), error  # read at the log interval (4) or the save (6)
    assert found.group(3) == "no checkpoint was saved or loaded before it, and nothing after it was saved"
    assert _saved(ckpt) == []


@pytest.mark.slow
def test_a_nan_loss_is_not_saved_on_the_way_out_and_the_rules_can_be_turned_off(tmp_path):
    data, ckpt = byte_data(tmp_path / "bytes"), tmp_path / "ckpt"
    flags = {"lr": 1e30, "fp16": True, "train-iters": 12, "log-interval": 4, "save-interval": 6,
             "lr-warmup-iters": 0}
    exiting = pretrain(tmp_path, data, **{**flags, "log-interval": 100, "save-interval": None, "exit-interval": 5})
    found = re.search(r"error: training stopped after iteration 5 because it has stopped learning: the loss of "
                      r"iteration (\d+) is nan \(read at iteration 5; --check-for-nan-in-loss-and-grad\)",
                      _error(exiting))
    assert found and int(found.group(1)) < 5 and _saved(ckpt) == [], exiting.stderr  # no save on the way out

    flags.update({"no-check-for-nan-in-loss-and-grad": True, "max-consecutive-skipped-iterations": 0,
                  "save": tmp_path / "unchecked"})
    run = pretrain(tmp_path, data, **flags)
    assert run.returncode == 0, (run.stdout + run.stderr)[-3000:]
    assert _saved(tmp_path / "unchecked") == ["global_step12", "global_step6"]
