"""torchrun jobs that lose a worker, from tests and bench/: launch with --max-restarts, wait for a line, kill
(or stop) one rank, and read each attempt's losses from the log.

    job = RestartJob(tmp_path, nproc=2, flags=tiny_flags(...), max_restarts=1)
    job.wait_for(r"saved checkpoint .*global_step10")
    job.signal_rank(1, signal.SIGKILL)
    job.finish()                      # the launcher's exit code (asserted 0 by the caller)
    before, after = job.attempts()    # {iteration: loss} logged by the first attempt, by the ones after it
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from typing import Dict, List, Optional, Tuple

from .launch import PRETRAIN
from .multirank import free_port

TRAIN_LINE = re.compile(r"iteration +(\d+)/ *\d+ \|.*?lm loss: ([0-9.E+-]+)")
RESUMED = re.compile(r"loaded checkpoint (\S+) \(")


class RestartJob:
    """One torchrun launch of pretrain_gpt.py with its output in `<where>/job.log`."""

    def __init__(self, where, nproc: int, flags: List[str], max_restarts: int = 1,
                 torchrun_args: Optional[List[str]] = None, env: Optional[dict] = None, log_name: str = "job.log"):
        self.log = os.path.join(str(where), log_name)
        launcher = torchrun_args if torchrun_args is not None else [
            "--nproc_per_node", str(nproc), "--master_addr", "127.0.0.1", "--master_port", str(free_port())]
        cmd = ([sys.executable, "-m", "torch.distributed.run"] + launcher
               + ["--max-restarts", str(max_restarts), PRETRAIN] + flags)
        self.proc = subprocess.Popen(cmd, stdout=open(self.log, "w"), stderr=subprocess.STDOUT,
                                     env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
                                     start_new_session=True)

    def text(self) -> str:
        with open(self.log) as f:
            return f.read()

    def wait_for(self, pattern: str, timeout: float = 300) -> re.Match:
        deadline = time.monotonic() + timeout
        while True:
            found = re.search(pattern, self.text())
            if found:
                return found
            assert self.proc.poll() is None, f"the job ended before {pattern!r}:\n{self.text()[-4000:]}"
            assert time.monotonic() < deadline, f"{pattern!r} not seen in {timeout} s:\n{self.text()[-4000:]}"
            time.sleep(0.02)

    def workers(self) -> Dict[int, int]:
        """{global rank: pid} of the launcher's current workers."""
        pids = subprocess.run(["ps", "-o", "pid=", "--ppid", str(self.proc.pid)], capture_output=True,
                              text=True).stdout.split()
        ranks = {}
        for pid in map(int, pids):
            try:
                with open(f"/proc/{pid}/environ", "rb") as f:
                    env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
            except OSError:
                continue
            if b"RANK" in env:
                ranks[int(env[b"RANK"])] = pid
        return ranks

    def signal_rank(self, rank: int, sig=signal.SIGKILL) -> float:
        """Send `sig` to the worker of global rank `rank`; -> the wall-clock time it was sent."""
        deadline = time.monotonic() + 60
        while rank not in self.workers():
            assert time.monotonic() < deadline, f"no worker of rank {rank}: {self.workers()}"
            time.sleep(0.05)
        os.kill(self.workers()[rank], sig)
        return time.time()

    def finish(self, timeout: float = 600) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"the job did not end in {timeout} s:\n{self.text()[-4000:]}") from None

    def kill(self):
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def attempts(self) -> Tuple[Dict[int, float], Dict[int, float]]:
        """({iteration: loss} logged before the first resume line, those logged after the last one)."""
        text = self.text()
        resumes = list(RESUMED.finditer(text))
        assert resumes, f"no resume in the log:\n{text[-4000:]}"
        first = {int(i): float(v) for i, v in TRAIN_LINE.findall(text[:resumes[0].start()])}
        last = {int(i): float(v) for i, v in TRAIN_LINE.findall(text[resumes[-1].end():])}
        return first, last


def resumed_from(text: str) -> List[str]:
    """The checkpoint directory of each resume, in order."""
    return [m.group(1) for m in RESUMED.finditer(text)]
