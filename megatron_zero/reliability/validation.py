"""What a step's results are checked for: host floats the step has already read (no device access here).

    checks = ResultChecks(nan=True, spiky_loss=True, large_grads=False, loss_factor=10, grads_factor=10,
                          window=100, dynamic_loss_scale=False)
    why = checks.failure(loss, grad_norm, overflow)   # None, or what failed, in words
    checks.accept(loss, grad_norm)                    # a step kept: it joins the window

  NaN/Inf   a non-finite loss; a non-finite gradient norm where the loss scale is not dynamic (under a
            dynamic fp16 scale an overflow is the scaler's to answer: it skips the step)
  spike     a loss at least `loss_factor` times the largest of the last `window` accepted losses, once
            the window is full (Megatron-LM's is_unexpectedly_large: factor 10 over 100 samples)
  large     the same for the gradient norm (Megatron-LM's --check-for-large-grads, factor 10)
"""
from __future__ import annotations

import math
from collections import deque
from typing import Optional


class ResultChecks:
    def __init__(self, nan: bool, spiky_loss: bool, large_grads: bool, loss_factor: float, grads_factor: float,
                 window: int, dynamic_loss_scale: bool):
        self.nan, self.spiky_loss, self.large_grads = nan, spiky_loss, large_grads
        self.loss_factor, self.grads_factor, self.dynamic = loss_factor, grads_factor, dynamic_loss_scale
        self.losses: deque = deque(maxlen=window)
        self.norms: deque = deque(maxlen=window)

    def failure(self, loss: float, grad_norm: float, overflow: bool) -> Optional[str]:
        """What the step's results fail, or None."""
        if self.nan and not math.isfinite(loss):
            return f"found {'NaN' if loss != loss else 'Inf'} in the loss"
        if self.nan and not self.dynamic and (overflow or not math.isfinite(grad_norm)):
            return "found NaN or Inf in the gradients"
        if self.spiky_loss and _spike(abs(loss), self.losses, self.loss_factor):
            return f"spiky loss (at least {self.loss_factor:g}x the largest of the last {self.losses.maxlen})"
        if self.large_grads and not overflow and _spike(grad_norm, self.norms, self.grads_factor):
            return f"unexpectedly large gradients (at least {self.grads_factor:g}x the largest of the last " \
                   f"{self.norms.maxlen})"
        return None

    def accept(self, loss: float, grad_norm: float) -> None:
        if math.isfinite(loss):
            self.losses.append(abs(loss))
        if math.isfinite(grad_norm):
            self.norms.append(grad_norm)


def _spike(value: float, window: deque, factor: float) -> bool:
    return math.isfinite(value) and len(window) == window.maxlen and value >= factor * max(window)
