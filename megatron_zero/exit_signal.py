"""Agreeing to stop: SIGTERM/SIGUSR1 (what SLURM sends before a job's time runs out),
--exit-duration-in-mins and --exit-interval.

A signal only sets a flag; after each iteration every rank calls `should_exit`,
which all-reduces the flags so all ranks stop after the same iteration, save,
and exit 0.
"""
from __future__ import annotations

import signal
import time
from typing import Optional

import torch
import torch.distributed as dist

from .device import HOST

EXIT_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class ExitPolicy:
    def __init__(self, handle_signals: bool = False, duration_mins: Optional[float] = None,
                 exit_interval: Optional[int] = None, start_time: Optional[float] = None,
                 device: torch.device = HOST):
        self.device = device  # the flags are all-reduced there (NCCL reduces device tensors only)
        self.received: Optional[int] = None
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

    def should_exit(self, iteration: int) -> Optional[str]:
        """The reason to stop after this iteration (the same on every rank), or None."""
        reasons = [
            self.received is not None,
            self.duration_mins is not None and (time.monotonic() - self.start) / 60.0 >= self.duration_mins,
            bool(self.exit_interval) and iteration % self.exit_interval == 0,
        ]
        flags = torch.tensor([float(r) for r in reasons], device=self.device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        if flags[0] > 0:
            return "exit signal received"
        if flags[1] > 0:
            return f"--exit-duration-in-mins {self.duration_mins} reached"
        if flags[2] > 0:
            return f"--exit-interval {self.exit_interval} reached"
        return None
