"""A changed schedule argument on resume is checked against the checkpoint's, as Megatron-LM's
OptimizerParamScheduler does, driven as a user does (pretrain_gpt.py, 1 rank): a run saved at --train-iters 2
resumed with --train-iters 4 (the decay length follows it) is refused in one sentence naming both values and
--override-opt_param-scheduler / --use-checkpoint-opt_param-scheduler; with the latter the checkpoint's schedule
runs: its cosine decay ended at iteration 2, so iterations 3 and 4 run at --min-lr. Before, the decay was
re-derived from the new --train-iters silently (iteration 3 at 2.325e-3) and the flag was unknown.
(tests/test_schedule_resume.py holds each flag's check and both modes against Megatron-Core's scheduler.)"""
import re
import subprocess
import sys

import pytest

from megatron_zero.testing.cli import PRETRAIN, cli_flags, pretrain_cli, text_data

pytestmark = pytest.mark.multirank


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """-> flags(*changes): the command line resuming a run saved at iteration 2 of --train-iters 2."""
    tmp_path = tmp_path_factory.mktemp("schedule")
    data = text_data(str(tmp_path / "text"))
    save = str(tmp_path / "ckpt")

    def flags(*changes):
        return cli_flags(data, str(tmp_path / "cache"), "llama", {"save": save, "load": save, "save-interval": 2},
                         *changes)

    pretrain_cli(1, flags({"train-iters": 2}))
    return flags


def test_changed_train_iters_on_resume_is_refused(saved):
    refused = subprocess.run([sys.executable, PRETRAIN] + saved({"train-iters": 4}), capture_output=True, text=True,
                             timeout=300)
    out = refused.stdout + refused.stderr
    assert refused.returncode != 0, out[-3000:]
    assert "decay length (lr_decay_steps) is 4 from the flags" in out and "but 2 in the checkpoint" in out, out[-3000:]
    assert "--override-opt_param-scheduler" in out and "--use-checkpoint-opt_param-scheduler" in out, out[-3000:]
    assert "Traceback" not in out, out[-3000:]


@pytest.mark.slow  # the default tier's test_schedule_resume.py holds this mode against Megatron-Core's scheduler
def test_use_checkpoint_opt_param_scheduler_runs_the_checkpoints_schedule(saved):
    resumed = pretrain_cli(1, saved({"train-iters": 4, "use-checkpoint-opt_param-scheduler": True}))
    lrs = {int(i): float(lr) for i, lr in re.findall(r"iteration\s+(\d+)/.*?learning rate: ([0-9.E+-]+)",
                                                     resumed.stdout)}
    assert sorted(lrs) == [3, 4], resumed.stdout[-3000:]
    assert lrs[3] == pytest.approx(3e-4) and lrs[4] == pytest.approx(3e-4), lrs
