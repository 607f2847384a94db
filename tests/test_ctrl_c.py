"""Ctrl-C, as a person presses it in the terminal of a run (SIGINT to the foreground process group: the job
started in a session of its own here, so killpg is the terminal's keystroke):

- once: the rank that writes the log says at once that the run will stop and save; every rank stops after
  the same iteration, saves it (`latest` and `latest_checkpointed_iteration.txt` name it), and the run ends
  with its summary line and exit code 0 (pretrain_gpt.py on one process; and two ranks through
  scripts/pretrain_torchrun.sh, which passes Ctrl-C on to the workers and keeps torchrun out of it);
- twice: it stops at once, one line naming what was saved, exit code 130, no traceback from any rank or from
  torchrun.
Before this, Ctrl-C printed a KeyboardInterrupt traceback per rank (and torchrun's SignalException's) and
saved nothing."""
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from megatron_zero.testing.launch import PRETRAIN, ROOT, byte_data, tiny_flags
from megatron_zero.testing.multirank import free_port

ACK = ("Ctrl-C: the run stops and saves at the end of an iteration, the one all ranks agree on; press Ctrl-C again "
       "to stop at once without saving")


def _start(tmp_path, ranks, **changes):
    data, log = byte_data(tmp_path / "bytes"), tmp_path / "job.log"
    flags = tiny_flags(tmp_path, data, **{"train-iters": 100000, **changes})
    if ranks == 1:
        cmd = [sys.executable, PRETRAIN] + flags
    else:
        cmd = ["bash", os.path.join(ROOT, "scripts", "pretrain_torchrun.sh"), "--nproc_per_node", str(ranks),
               "--master_addr", "127.0.0.1", "--master_port", str(free_port()), PRETRAIN] + flags
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_PORT": str(free_port()), "PYTHON": sys.executable}
    job = subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env, start_new_session=True)
    return job, log


def _wait_for(log, pattern, job, timeout=240):
    deadline = time.monotonic() + timeout
    while not re.search(pattern, log.read_text(), re.M):
        assert job.poll() is None, log.read_text()[-3000:]
        assert time.monotonic() < deadline, f"{pattern!r} not seen: {log.read_text()[-3000:]}"
        time.sleep(0.01)


def _press_ctrl_c(tmp_path, ranks, times, **changes):
    job, log = _start(tmp_path, ranks, **changes)
    try:
        _wait_for(log, r" iteration +3/", job)
        os.killpg(job.pid, signal.SIGINT)
        if times == 2:
            _wait_for(log, "^" + re.escape(ACK) + "$", job)
            os.killpg(job.pid, signal.SIGINT)
        code = job.wait(timeout=240)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    out = log.read_text()
    assert "Traceback" not in out and "KeyboardInterrupt" not in out and "SignalException" not in out, out[-3000:]
    assert [line for line in out.splitlines() if line.startswith("Ctrl-C:")] == [ACK], out[-3000:]  # one rank
    assert out.count("stopped at once by Ctrl-C") == (times == 2), out[-3000:]
    return code, out


def _check_saved_and_summarised(tmp_path, code, out):
    ckpt = tmp_path / "ckpt"
    assert code == 0, out[-3000:]
    stopped = int(re.findall(r"^exiting after iteration (\d+): Ctrl-C received$", out, re.M)[0])
    assert (ckpt / "latest").read_text().strip() == f"global_step{stopped}"
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == str(stopped)
    assert re.search(rf"^saved checkpoint {re.escape(str(ckpt / f'global_step{stopped}'))} in ", out, re.M), out
    losses = re.findall(r"iteration +(\d+)/ +\d+ \|.*\| lm loss: ([0-9.E+-]+) \|", out)
    assert int(losses[-1][0]) == stopped, out[-3000:]
    summary = re.findall(r"^training done: .*$", out, re.M)
    assert len(summary) == 1 and summary[0] == out.rstrip("\n").splitlines()[-1], out[-3000:]
    found = re.fullmatch(rf"training done: iterations 0 to {stopped} \({stopped} run\), {stopped * 4 * 16} tokens in "
                         r"([0-9.]+) s \((\d+) tokens/s\); final lm loss ([0-9.E+-]+) \(iteration "
                         rf"{stopped} alone; a log line averages its interval\); last checkpoint "
                         rf"{re.escape(str(ckpt / f'global_step{stopped}'))}", summary[0])
    assert found, summary[0]
    seconds, rate, final = float(found.group(1)), int(found.group(2)), float(found.group(3))
    tokens = stopped * 64  # the line's seconds are rounded to 0.1, its rate to 1 token/s
    assert tokens / (seconds + 0.05) - 0.5 <= rate <= tokens / max(seconds - 0.05, 1e-9) + 0.5, summary[0]
    assert final == float(losses[-1][1])  # --log-interval 1: the log line's average is that iteration's loss


def test_ctrl_c_saves_at_the_next_iteration_and_exits_zero(tmp_path):
    code, out = _press_ctrl_c(tmp_path, 1, 1)
    _check_saved_and_summarised(tmp_path, code, out)


@pytest.mark.slow  # test_ctrl_c_saves_at_the_next_iteration_and_exits_zero: the same on one process
@pytest.mark.multirank
def test_ctrl_c_through_the_launch_script_saves_on_every_rank(tmp_path):
    code, out = _press_ctrl_c(tmp_path, 2, 1)
    _check_saved_and_summarised(tmp_path, code, out)


@pytest.mark.slow  # tests/test_exit_and_throughput.py's test_ctrl_c_votes_once_then_interrupts: the second press
@pytest.mark.multirank
@pytest.mark.parametrize("ranks", [1, 2])
def test_a_second_ctrl_c_stops_at_once(tmp_path, ranks):
    """A wider model than the tiny one, so that the second press lands before the save is done."""
    code, out = _press_ctrl_c(tmp_path, ranks, 2, **{"hidden-size": 256, "num-layers": 4})
    assert code == 130, out[-3000:]
    assert out.rstrip("\n").splitlines()[-1] == ("pretrain_gpt.py: stopped at once by Ctrl-C; no checkpoint was "
                                                 "saved or loaded"), out[-3000:]
    assert not (tmp_path / "ckpt" / "latest").exists() and "training done" not in out
