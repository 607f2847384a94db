"""The last guard against a hung job: a thread that ends this rank when no training step has finished for
twice --distributed-timeout-minutes.

Every collective is meant to give up after --distributed-timeout-minutes (NCCL's watchdog, gloo's timeout, the
shared-memory collectives' own), but not every wait does: a gloo all-reduce whose peer is stopped (SIGSTOP,
a debugger, a wedged host) was seen waiting past its timeout with none of gloo's threads at work. A job in
that state burns its allocation and tells nobody; torchrun restarts it only once a worker exits. The watchdog
reads the iteration counter; armed at the first finished step (start-up, loading and the first step may take
long), it says which rank lost contact (distributed.lost_contact_line, naming a stopped or vanished rank on
this host) and exits 1 from the process, as a broken collective would.

    watch_steps(trainer, minutes, world_size)   # a job of several ranks: started, ends with the trainer
    dog = StepWatchdog(iteration, minutes)      # `iteration()`: the steps finished; None: stop watching
    dog.stop()
"""
from __future__ import annotations

import os
import sys
import threading
import time
import weakref
from typing import Callable, Optional

from ..distributed.initialize import lost_contact_line, record_peer_loss


class StepWatchdog:
    def __init__(self, iteration: Callable[[], Optional[int]], timeout_minutes: float, poll_s: float = 1.0):
        self.iteration, self.limit, self.poll = iteration, 2 * timeout_minutes * 60, poll_s
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._watch, name="megatron_zero-step-watchdog", daemon=True)
        self.thread.start()

    def _watch(self):
        first, last, since = self.iteration(), None, time.monotonic()
        while not self.done.wait(self.poll):
            now = self.iteration()
            if now is None:  # the run is over
                return
            if now != last:
                last, since = now, time.monotonic()
                continue
            if now != first and time.monotonic() - since > self.limit:
                self._fire(now)

    def _fire(self, iteration: int):
        why = TimeoutError(f"no training step finished in {self.limit:.0f} s after iteration {iteration}, twice "
                           "--distributed-timeout-minutes")
        line = lost_contact_line(why)
        print(f"pretrain_gpt.py: error: {line}", file=sys.stderr, flush=True)
        record_peer_loss(line)
        sys.stdout.flush()
        os._exit(1)

    def stop(self):
        self.done.set()
        self.thread.join()


def watch_steps(trainer, timeout_minutes: float, world_size: int) -> Optional[StepWatchdog]:
    """A StepWatchdog on `trainer`'s iteration counter for a job of several ranks (a rank alone has no peer to
    wait on), holding the trainer weakly: it stops once the trainer is freed, and does not keep its process
    groups alive (distributed.shutdown_distributed)."""
    if world_size <= 1:
        return None
    ref = weakref.ref(trainer)
    return StepWatchdog(lambda: None if ref() is None else ref().progress.iteration, timeout_minutes)
