"""Agreeing to stop: SIGTERM/SIGUSR1 (what SLURM sends before a job's time runs out), Ctrl-C (SIGINT),
--exit-duration-in-mins and --exit-interval.

Ctrl-C is a person stopping the run by hand, so it is always handled (where the loop runs in the main
thread), with or without --exit-signal-handler: the first one is a vote like SIGTERM's (stop after this
iteration, save, exit 0), and the rank that writes the log says so at once, in one line; a second one
raises KeyboardInterrupt, which pretrain() turns into one line and exit code 130 (training/trainer.py). Under
torchrun the terminal's Ctrl-C reaches torchrun, not the workers (each in a session of its own):
torchrun passes it on when it shuts down (and kills them after its --shutdown-timeout, 30 s), while
scripts/pretrain_torchrun.sh passes each one on and leaves torchrun running.

A signal only sets a flag. --exit-interval needs no agreement (every rank counts the same
iterations). The signal and the time limit do, since ranks see them at different moments: each rank's
`votes()` (signal received, time limit reached) ride in the optimizer step's own all-reduce (the
global gradient norm's, ZeroOptimizer.step(votes=...)), summed over every rank, and `should_exit`
decides from those sums, so all ranks stop after the same iteration, save, and exit 0, at the cost
of no collective and no host read of their own. Without a signal handler, Ctrl-C's and a time limit
there is nothing to vote on. `should_exit` without the sums all-reduces the votes itself (a collective).
"""
from __future__ import annotations

import os
import signal
import sys
import threading
import time
from typing import Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from ..distributed.device import HOST
from ..distributed.initialize import read_launch_env

EXIT_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
CTRL_C_REASON = "Ctrl-C received"


def ctrl_c_line(saving: bool) -> str:
    """What the first Ctrl-C answers at once (the stop itself comes at the end of the iteration)."""
    return ("Ctrl-C: the run stops " + ("and saves " if saving else "(no --save: nothing is saved) ") + "at the end "
            "of an iteration, the one all ranks agree on; press Ctrl-C again to stop at once"
            + (" without saving" if saving else ""))


INTERRUPTED = 130  # the exit code of a run stopped at once by Ctrl-C (128 + SIGINT, as a shell reports it)


def report_interrupt(last_checkpoint: Optional[str]) -> int:
    """Say, from global rank 0 (on stderr), that the run stopped at once by Ctrl-C (a second one, or one before
    training began) and what its last checkpoint is; -> INTERRUPTED."""
    if read_launch_env().rank == 0:
        print("pretrain_gpt.py: stopped at once by Ctrl-C; " + (
            f"the last checkpoint is {last_checkpoint}, and nothing after it was saved" if last_checkpoint else
            "no checkpoint was saved or loaded"), file=sys.stderr, flush=True)
    return INTERRUPTED


class ExitPolicy:
    def __init__(self, handle_signals: bool = False, duration_mins: Optional[float] = None,
                 exit_interval: Optional[int] = None, start_time: Optional[float] = None,
                 device: torch.device = HOST, ctrl_c: bool = False, announce: Optional[str] = None):
        """`ctrl_c`: the first SIGINT votes to stop, the second raises KeyboardInterrupt (module docstring);
        `announce`: the line this rank writes to stdout on the first one (None: another rank says it)."""
        self.device = device  # where should_exit all-reduces the votes itself (NCCL reduces device tensors only)
        self.received: Optional[int] = None
        self.handles_signals = handle_signals
        self.ctrl_c = ctrl_c and threading.current_thread() is threading.main_thread()
        self.ctrl_c_received = False
        self.announce = announce
        self.duration_mins = duration_mins
        self.exit_interval = exit_interval
        self.start = time.monotonic() if start_time is None else start_time
        self._previous = {}
        if handle_signals:
            for sig in EXIT_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._on_signal)
        if self.ctrl_c:
            self._previous[signal.SIGINT] = signal.signal(signal.SIGINT, self._on_ctrl_c)

    def _on_signal(self, signum, frame):
        self.received = signum

    def _on_ctrl_c(self, signum, frame):
        if self.ctrl_c_received:
            raise KeyboardInterrupt
        self.ctrl_c_received = True
        self.received = signum
        if self.announce:  # os.write: the handler may run in the middle of a print to the same stream
            os.write(sys.stdout.fileno(), (self.announce + "\n").encode())

    def restore(self):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def votes(self) -> Tuple[float, ...]:
        """This rank's (signal received, time limit reached) as 0/1, to be summed over every rank;
        () when neither can happen (no signal handler, no time limit)."""
        if not self.handles_signals and not self.ctrl_c and self.duration_mins is None:
            return ()
        out_of_time = self.duration_mins is not None and (time.monotonic() - self.start) / 60.0 >= self.duration_mins
        return float(self.received is not None), float(out_of_time)

    def should_exit(self, iteration: int, summed_votes: Optional[Sequence[float]] = None) -> Optional[str]:
        """The reason to stop after this iteration (the same on every rank), or None.

        `summed_votes`: `votes()` taken at this iteration's optimizer step, summed over every rank
        (ZeroOptimizer.summed_votes); None: take and all-reduce them here (a collective)."""
        if summed_votes is None:
            summed_votes = self._all_reduce(self.votes())
        if summed_votes and summed_votes[0] > 0:
            return CTRL_C_REASON if self.ctrl_c_received else "exit signal received"
        if summed_votes and summed_votes[1] > 0:
            return f"--exit-duration-in-mins {self.duration_mins} reached"
        if self.exit_interval and iteration % self.exit_interval == 0:
            return f"--exit-interval {self.exit_interval} reached"
        return None

    def _all_reduce(self, votes: Tuple[float, ...]) -> Sequence[float]:
        if not votes or not (dist.is_initialized() and dist.get_world_size() > 1):
            return votes
        summed = torch.tensor(votes, dtype=torch.float64, device=self.device)
        dist.all_reduce(summed)
        return summed.tolist()
