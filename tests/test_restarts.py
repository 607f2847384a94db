"""torchrun --max-restarts as a user runs it: a worker SIGKILLed after a checkpoint, the launcher restarts every
worker, and the run resumes from the newest checkpoint under --load by itself and finishes.

Bit-identical after the resume: the restarted attempt is the same ranks running the same operations on the
restored state (weights, Adam moments, lr schedule, data position, RNG), so each iteration the first attempt
logged after the checkpoint is logged again with the same loss (fp32, one thread a rank; see
tests/test_cli_resume.py).

Before attempts formed their group from their own part of the launcher's store (distributed.attempt_store),
the restarted workers read the gloo addresses the killed attempt had left in torchrun's store and hung in
init_process_group until --distributed-timeout-minutes, then the job failed.
"""
import os
import signal
import subprocess
import sys

import pytest
from conftest import ROOT

from megatron_zero.testing.launch import byte_data, tiny_flags
from megatron_zero.testing.restarts import RestartJob, resumed_from


def restart_flags(tmp_path, data, **changes):
    return tiny_flags(tmp_path, data, **{"train-iters": 24, "save-interval": 10, "load": tmp_path / "ckpt",
                                         "distributed-timeout-minutes": 1, **changes})


def test_a_killed_worker_is_restarted_and_the_run_resumes_bit_identically(tmp_path):
    # its cost is starting and ending Python and torch: the launcher and two workers, the workers twice (23 s
    # measured here: 10 s to the first iteration, 8 s from the kill to the resume, 5 s of exits); the 24
    # iterations take under a second, so fewer iterations or a smaller model would not make it cheaper, and
    # fewer than two ranks would not test the attempts' rendezvous
    data = byte_data(tmp_path / "bytes")
    job = RestartJob(tmp_path, 2, restart_flags(tmp_path, data))
    try:
        job.wait_for(r"iteration +11/")  # the checkpoint at 10 is committed before iteration 11 runs
        job.signal_rank(1, signal.SIGKILL)
        assert job.finish() == 0, job.text()[-4000:]
    finally:
        job.kill()
    text = job.text()
    before, after = job.attempts()
    resumed = int(resumed_from(text)[0].rsplit("global_step", 1)[1])
    assert resumed >= 10 and max(after) == 24 and min(after) == resumed + 1, text[-4000:]
    again = sorted(set(before) & set(after))
    assert again, f"no iteration was logged by both attempts:\n{text[-4000:]}"
    assert [before[i] for i in again] == [after[i] for i in again]
    assert "Default process group has not been initialized" not in text


@pytest.mark.slow  # covered in the default tier by the killed worker above (the same restart)
def test_a_stopped_rank_ends_the_attempt_within_the_timeout_and_the_run_restarts(tmp_path):
    """A rank stopped (SIGSTOP: a hung process) holds every other rank in a collective: the wait ends at
    --distributed-timeout-minutes with one sentence naming the stopped rank, torchrun restarts the workers
    (the stopped one killed), and the run resumes and finishes."""
    data = byte_data(tmp_path / "bytes")
    job = RestartJob(tmp_path, 2, restart_flags(tmp_path, data, **{"distributed-timeout-minutes": 0.25}))
    try:
        job.wait_for(r"iteration +11/")
        job.signal_rank(1, signal.SIGSTOP)
        job.wait_for(r"lost contact with rank 1 on \S+ \(stopped\)", 120)
        assert job.finish() == 0, job.text()[-4000:]
    finally:
        job.kill()
    before, after = job.attempts()
    again = sorted(set(before) & set(after))
    assert again and max(after) == 24 and [before[i] for i in again] == [after[i] for i in again]


WATCHED = """
import time
from megatron_zero.elastic.watchdog import StepWatchdog
steps = iter([0, 1])
StepWatchdog(lambda: next(steps, 1), timeout_minutes=0.01, poll_s=0.05)  # one step, then none
time.sleep(60)
print("still running")
"""


def test_a_job_whose_steps_stop_is_ended_by_the_watchdog():
    """A wait that outlives its collective's timeout (seen: a gloo all-reduce whose peer was stopped) still
    ends the rank after twice --distributed-timeout-minutes without a finished step, with the sentence of a
    rank that lost contact and exit code 1, so torchrun restarts the job."""
    run = subprocess.run([sys.executable, "-c", WATCHED], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": ROOT})
    assert run.returncode == 1 and "still running" not in run.stdout, run.stderr[-2000:]
    assert run.stderr.strip().startswith("pretrain_gpt.py: error: rank 0 on ") and (
        "no training step finished in 1 s after iteration 1, twice --distributed-timeout-minutes" in run.stderr)


@pytest.mark.slow  # the tier's save and load are the ordinary ones the default tier's resume tests cover
def test_the_local_tier_loses_fewer_iterations_than_save_alone(tmp_path):
    """--save every 10 iterations and the local tier every 2: a worker killed after iteration 15 resumes from
    the local copy (iteration 14 or later), bit-identically; --save alone would resume from 10."""
    data = byte_data(tmp_path / "bytes")
    local = tmp_path / "local"
    job = RestartJob(tmp_path, 2, restart_flags(tmp_path, data, **{
        "non-persistent-save-interval": 2, "non-persistent-ckpt-type": "local",
        "non-persistent-local-ckpt-dir": local}))
    try:
        job.wait_for(r"iteration +15/")
        job.signal_rank(1, signal.SIGKILL)
        assert job.finish() == 0, job.text()[-4000:]
    finally:
        job.kill()
    text = job.text()
    resumed = resumed_from(text)[0]
    step = int(resumed.rsplit("global_step", 1)[1])
    before, after = job.attempts()
    assert step >= 14 and f"from {local / resumed}" in text, text[-4000:]
    assert f"resuming from the local checkpoint tier {local} (iteration {step}), newer than --load" in text
    assert max(before) - step < max(before) - 10  # fewer iterations trained again than from --save's
    again = sorted(set(before) & set(after))
    assert max(after) == 24 and [before[i] for i in again] == [after[i] for i in again]
    assert sorted(os.listdir(local)) == ["global_step24", "latest", "latest_checkpointed_iteration.txt"]  # the newest
