"""--decoupled-lr through the command line: pretrain_gpt.py trains the tiny Llama at PP2 (the first stage holds the
word embedding, the last the output layer) with --decoupled-lr 9e-3 --decoupled-min-lr 1e-3 for 6 iterations,
saving at 3.

Claims: each train line logs `learning rate` and `decoupled learning rate` at Megatron's formula (to the 7 printed
digits); the run resumed as saved logs the uninterrupted losses bit-identically, the one converted by
tools/ds_to_universal.py and resumed at TP2 within 1e-5 (tests/test_cli_resume.py derives both); a plain resume
without --decoupled-lr (two param groups where the checkpoint has three) is refused in one sentence that names
the universal path, and that path resumes it. The universal resumes are `slow`.
"""
import math
import os
import re
import subprocess
import sys

import pytest

from megatron_zero.testing.cli import TINY, CliResume, cli_flags, layout_flags, logged_losses, text_data
from megatron_zero.testing.launch import PRETRAIN
from megatron_zero.testing.multirank import free_port

pytestmark = pytest.mark.multirank
DECOUPLED = {"decoupled-lr": 9e-3, "decoupled-min-lr": 1e-3}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli_decoupled")
    data = text_data(root / "text")
    return CliResume(str(root), lambda *changes: cli_flags(data, str(root / "cache"), "llama", DECOUPLED, *changes),
                     layout_flags(pp=2))


def megatron_lr(n, peak, floor, warmup, decay):
    if n <= warmup:
        return peak * n / warmup
    if n > decay:
        return floor
    return floor + 0.5 * (math.cos(math.pi * (n - warmup) / (decay - warmup)) + 1.0) * (peak - floor)


def test_log_shows_both_learning_rates(run):
    found = re.findall(r"iteration +(\d+)/ *\d+ \|.*?\| learning rate: ([0-9.E+-]+) \| decoupled learning rate: "
                       r"([0-9.E+-]+) \|", run.stdout)
    assert [int(it) for it, _, _ in found] == list(range(1, run.iters + 1)), run.stdout[-2000:]
    for it, lr, own in found:
        n = int(it) - 1  # the lr of iteration i is the schedule's after i - 1 steps (Megatron's too)
        want = megatron_lr(n, TINY["lr"], TINY["min-lr"], TINY["lr-warmup-iters"], run.iters)
        want_own = megatron_lr(n, DECOUPLED["decoupled-lr"], DECOUPLED["decoupled-min-lr"], TINY["lr-warmup-iters"],
                               run.iters)
        assert abs(float(lr) - want) <= 1e-6 * want and abs(float(own) - want_own) <= 1e-6 * want_own, (it, lr, own)


def test_resume_as_saved_is_bit_identical(run):
    run.assert_matches(run.resume(), 0.0)


@pytest.mark.slow
def test_universal_resume_at_another_layout_and_regrouped(run):
    run.assert_matches(run.resume("universal", layout_flags(tp=2)), 1e-5)
    regrouped = run._run({"load": run.universal, "universal-checkpoint": True, "decoupled-lr": None,
                          "decoupled-min-lr": None})
    assert sorted(logged_losses(regrouped)) == list(range(run.save_at + 1, run.iters + 1))
    assert "decoupled learning rate" not in regrouped.stdout


def test_plain_resume_that_drops_it_is_refused(run):
    argv = run.flags({"train-iters": run.iters}, run.layout, {"load": run.checkpoint, "decoupled-lr": None,
                                                              "decoupled-min-lr": None})
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           PRETRAIN] + [str(a) for a in argv]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode != 0
    assert "was saved with --decoupled-lr and this run is without it" in done.stderr
    assert "ds_to_universal.py" in done.stderr
    # one sentence from one rank, first (torchrun then reports the exit status in its own words)
    assert done.stderr.startswith("pretrain_gpt.py: error: ") and done.stderr.count("pretrain_gpt.py: error") == 1
