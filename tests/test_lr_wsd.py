"""--lr-decay-style WSD (with --lr-wsd-decay-style and --lr-wsd-decay-iters / -samples) and inverse-square-root:
the learning rate of every step equals Megatron-Core 0.16.1's OptimizerParamScheduler's, from the flags as
pretrain_gpt.py parses them (iteration- and sample-based), and a run from the command line logs them."""
import re

import pytest
import torch

from megatron_zero.config import from_args
from megatron_zero.arguments import parse_args
from megatron_zero.optimizer.lr_schedule import build_lr_schedule
from megatron_zero.testing.flag_checks import BASE, refused, with_flags
from megatron_zero.testing.launch import byte_data, pretrain

mcore_scheduler = pytest.importorskip("megatron.core.optimizer_param_scheduler")

ITERS, GBS = 40, 16  # BASE's global batch


def reference(style, wsd_style, warmup, decay, wsd, lr=1e-3, min_lr=1e-5):
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    return mcore_scheduler.OptimizerParamScheduler(
        opt, init_lr=0.0, max_lr=lr, min_lr=min_lr, lr_warmup_steps=warmup, lr_decay_steps=decay,
        lr_decay_style=style, start_wd=0.0, end_wd=0.0, wd_incr_steps=1, wd_incr_style="constant",
        wsd_decay_steps=wsd, lr_wsd_decay_style=wsd_style)


@pytest.mark.parametrize("style,wsd_style", [("WSD", "exponential"), ("WSD", "linear"), ("WSD", "cosine"),
                                             ("WSD", "minus_sqrt"), ("inverse-square-root", None)])
def test_every_step_equals_megatron_core(style, wsd_style):
    extra = dict(lr_decay_style=style, lr_warmup_iters=5, min_lr=1e-5, train_iters=ITERS)
    if wsd_style:
        extra.update(lr_wsd_decay_style=wsd_style, lr_wsd_decay_iters=12)
    args = parse_args(with_flags(BASE, **extra), world_size=1)
    ours = build_lr_schedule(from_args(args))
    # Megatron-Core counts an iteration-based run's schedule in samples (steps x global batch)
    theirs = reference(style, wsd_style or "exponential", 5 * GBS, ITERS * GBS, 12 * GBS if wsd_style else None)
    for step in range(ITERS + 2):
        theirs.num_steps = step * GBS
        assert ours.lr(step) == pytest.approx(theirs.get_lr(theirs.optimizer.param_groups[0]), rel=1e-12, abs=1e-15)


def test_sample_based_wsd_equals_megatron_core():
    argv = [a for a in BASE if a not in ("--train-iters", "10")]
    args = parse_args(argv + ["--train-samples", "320", "--lr-decay-style", "WSD", "--lr-wsd-decay-samples", "96",
                              "--lr-wsd-decay-style", "linear", "--lr-warmup-samples", "32", "--min-lr", "1e-5"],
                      world_size=1)
    ours, theirs = build_lr_schedule(from_args(args)), reference("WSD", "linear", 32, 320, 96)
    for samples in range(0, 336, 16):
        theirs.num_steps = samples
        assert ours.lr(samples) == pytest.approx(theirs.get_lr(theirs.optimizer.param_groups[0]), rel=1e-12)


def test_wsd_without_its_decay_length_refused(capsys):
    line = refused(with_flags(BASE, lr_decay_style="WSD"), 1, capsys)
    assert "--lr-wsd-decay-iters" in line


def test_cli_logs_the_wsd_schedule(tmp_path):
    run = pretrain(tmp_path, byte_data(str(tmp_path / "bytes")),
                   **{"train-iters": 6, "lr": 1e-3, "min-lr": 0.0, "lr-warmup-iters": 1, "lr-decay-style": "WSD",
                      "lr-wsd-decay-iters": 2, "lr-wsd-decay-style": "linear"})
    assert run.returncode == 0, run.stderr[-2000:]
    lrs = [float(x) for x in re.findall(r"learning rate: ([0-9.E+-]+)", run.stdout + run.stderr)]
    # the rate of the step after n completed ones (Megatron-LM's): warm-up from 0, stable at 1e-3 through n = 4
    # (decay span 6 less the WSD's 2), then linear over the last 2: half way at n = 5
    assert lrs == pytest.approx([0.0, 1e-3, 1e-3, 1e-3, 1e-3, 5e-4]), lrs
