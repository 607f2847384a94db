"""Agreeing to stop: SIGTERM/SIGUSR1 (what SLURM sends before a job's time runs out),
--exit-duration-in-mins and --exit-interval.

A signal only sets a flag. --exit-interval needs no agreement (every rank counts the same
iterations). The signal and the time limit do, since ranks see them at different moments: each rank's
`votes()` (signal received, time limit reached) ride in the optimizer step's own all-reduce (the
global gradient norm's, ZeroOptimizer.step(votes=...)), summed over every rank, and `should_exit`
decides from those sums, so all ranks stop after the same iteration, save, and exit 0, at the cost
of no collective and no host read of their own. Without a signal handler and a time limit there is
nothing to vote on. `should_exit` without the sums all-reduces the votes itself (a collective).
"""
from __future__ import annotations

import signal
import time
from typing import Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from .device import HOST

EXIT_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class ExitPolicy:
    def __init__(self, handle_signals: bool = False, duration_mins: Optional[float] = None,
                 exit_interval: Optional[int] = None, start_time: Optional[float] = None,
                 device: torch.device = HOST):
        self.device = device  # where should_exit all-reduces the votes itself (NCCL reduces device tensors only)
        self.received: Optional[int] = None
        self.handles_signals = handle_signals
        self.duration_mins = duration_mins
        self.exit_interval = exit_interval
        self.start = time.monotonic() if start_time is None else start_time
        self._previous = {}
        if handle_signals:
            for sig in EXIT_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._on_signal)

    def _on_signal(self, signum, frame):
        self.received = signum

    def restore(self):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def votes(self) -> Tuple[float, ...]:
        """This rank's (signal received, time limit reached) as 0/1, to be summed over every rank;
        () when neither can happen (no signal handler, no time limit)."""
        if not self.handles_signals and self.duration_mins is None:
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
            return "exit signal received"
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
