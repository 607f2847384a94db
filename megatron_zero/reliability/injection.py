"""--error-injection-rate / --error-injection-type: Megatron-LM's fault rehearsal, deterministic given the seed.

At each step every rank draws the same number r in [0, rate) from a generator seeded by (--seed, iteration),
and a rank injects when (r + rank) % rate == 0: Megatron-LM's rule (about one step in `rate` per rank), with
the draw a function of the iteration, so a resumed or re-run step draws what the first attempt drew and every
rank knows which ranks inject without a word exchanged.

What an injected error does to the step's result (the loss each rank holds for the step; reliability/rerun.py):
  transient_error   the injecting rank's copy is corrupted on the first run only: the re-run differs
  persistent_error  the injecting rank's copy is corrupted on every run: reproducible on that rank alone
  correct_result    every rank's copy is corrupted alike on every run, as bad data corrupts it: a genuine
                    anomaly, reproducible everywhere
The corruption is a NaN (the check every run makes, --check-for-nan-in-loss-and-grad).
"""
from __future__ import annotations

import random
from typing import Optional

CORRECT, TRANSIENT, PERSISTENT = "correct_result", "transient_error", "persistent_error"


class ErrorInjector:
    def __init__(self, rate: int, kind: str, seed: int, world_size: int):
        self.rate, self.kind, self.seed, self.world_size = rate, kind, seed, world_size

    def injecting_ranks(self, iteration: int) -> list:
        """The ranks that inject at `iteration` (1-based)."""
        if not self.rate:
            return []
        r = random.Random(f"{self.seed}:{iteration}").randrange(self.rate)
        return [rank for rank in range(self.world_size) if (r + rank) % self.rate == 0]

    def corrupts(self, iteration: int, rank: int, attempt: int) -> Optional[str]:
        """The kind of error `rank`'s copy of the result carries at this attempt (0: the first run), or None."""
        ranks = self.injecting_ranks(iteration)
        if not ranks:
            return None
        if self.kind == CORRECT:
            return CORRECT
        if rank not in ranks or (self.kind == TRANSIENT and attempt > 0):
            return None
        return self.kind
