"""A run that has stopped learning stops: the two rules, read from values the training loop holds anyway.

    rules = StopRules(max_skipped=50, check_nan=True, dynamic_loss_scale=True)
    reason = rules.after_step(iteration, updated, grad_norm)          # every step; None, or why it stops
    reason = rules.after_losses(iteration, first_nonfinite_loss)      # whenever the losses have been read

  --max-consecutive-skipped-iterations N   N optimizer steps in a row skipped (their gradients held inf or
      (default 50; 0: never)               NaN). Under a dynamic fp16 loss scale each skip halves the scale
                                           (after --hysteresis): DeepSpeed stops a run whose scale is at its
                                           floor and still overflows; falling from 2**32 (Megatron's initial
                                           scale, the largest in use) to 1 takes 32 halvings plus the
                                           hysteresis, so a healthy run never skips 50 steps in a row, and a
                                           collapsed one stops within 50 iterations instead of running on.
  --check-for-nan-in-loss-and-grad         (Megatron's flag and default; --no-check-for-nan-in-loss-and-grad
                                           turns it off) a non-finite loss, or, where the loss scale is not
                                           dynamic (bf16, fp32, a static fp16 scale), a non-finite gradient
                                           norm. Under a dynamic scale an inf/NaN norm is an overflow the
                                           scaler answers by skipping: the rule above is the one for that.

No rule reads the device: `updated` and `grad_norm` come from the step's one host read (the gradient norm's
all-reduce), and the losses are read where the loop reads them anyway (every --log-interval, and before
every save, so a checkpoint is never written from an iteration whose loss is known to be non-finite). Both
are the same on every rank (all-reduced), so every rank stops at the same iteration.
"""
from __future__ import annotations

import math
from typing import Optional, Tuple


class RunStopped(Exception):
    """The run stopped learning; the message is one sentence naming the iteration and the last checkpoint."""


class StopRules:
    def __init__(self, max_skipped: int, check_nan: bool, dynamic_loss_scale: bool):
        self.max_skipped, self.check_nan, self.dynamic = max_skipped, check_nan, dynamic_loss_scale
        self.skipped_in_a_row = 0

    def after_step(self, iteration: int, updated: bool, grad_norm: float) -> Optional[str]:
        """Why the run stops after the step of `iteration` (its host-read outcome), or None."""
        self.skipped_in_a_row = 0 if updated else self.skipped_in_a_row + 1
        if self.check_nan and not self.dynamic and not (updated and math.isfinite(grad_norm)):
            return (f"the gradients of iteration {iteration} hold inf or NaN (norm {grad_norm}; "
                    "--check-for-nan-in-loss-and-grad)")
        if self.max_skipped and self.skipped_in_a_row >= self.max_skipped:
            first = iteration - self.skipped_in_a_row + 1
            return (f"iterations {first} to {iteration} all skipped their optimizer step, their gradients "
                    f"overflowing (--max-consecutive-skipped-iterations {self.max_skipped})")
        return None

    def after_losses(self, iteration: int, first_nonfinite_loss: Optional[Tuple[int, float]]) -> Optional[str]:
        """Why the run stops, given (iteration, loss) of the first non-finite loss read so far (or None)."""
        if not self.check_nan or first_nonfinite_loss is None:
            return None
        at, loss = first_nonfinite_loss
        read = f"read at iteration {iteration}; " if at != iteration else ""
        return f"the loss of iteration {at} is {loss} ({read}--check-for-nan-in-loss-and-grad)"
