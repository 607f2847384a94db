"""Megatron's learning-rate schedule: linear warm-up, then constant/linear/cosine decay to min-lr."""
from __future__ import annotations

import math


class LRSchedule:
    def __init__(self, max_lr: float, min_lr: float = 0.0, warmup_steps: int = 0,
                 decay_steps: int = 0, decay_style: str = "linear", num_steps: int = 0):
        if decay_style not in ("constant", "linear", "cosine"):
            raise ValueError(f"lr decay style {decay_style!r} must be constant, linear or cosine")
        self.max_lr, self.min_lr = float(max_lr), float(min_lr)
        self.warmup_steps, self.decay_steps = int(warmup_steps), int(decay_steps)
        self.decay_style = decay_style
        self.num_steps = int(num_steps)

    def lr(self, step: int = None) -> float:
        """The learning rate for the optimizer step that follows `step` completed steps."""
        n = self.num_steps if step is None else step
        if self.warmup_steps > 0 and n <= self.warmup_steps:
            return self.max_lr * n / self.warmup_steps
        if self.decay_style == "constant":
            return self.max_lr
        if n > self.decay_steps:
            return self.min_lr
        span = self.decay_steps - self.warmup_steps
        ratio = (n - self.warmup_steps) / span if span > 0 else 1.0
        if self.decay_style == "linear":
            coeff = 1.0 - ratio
        else:
            coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
        return self.min_lr + coeff * (self.max_lr - self.min_lr)

    def step(self, increment: int = 1) -> float:
        self.num_steps += increment
        return self.lr()

    def state_dict(self) -> dict:
        # Megatron's OptimizerParamScheduler keys, so its tools recognise them.
        return {"max_lr": self.max_lr, "min_lr": self.min_lr, "lr_warmup_steps": self.warmup_steps,
                "lr_decay_steps": self.decay_steps, "lr_decay_style": self.decay_style,
                "num_steps": self.num_steps}

    def load_state_dict(self, state: dict):
        self.num_steps = int(state["num_steps"])
