"""Megatron's learning-rate schedule: linear warm-up, then constant / linear / cosine / WSD / inverse-square-root
decay to min-lr, with Megatron-Core's OptimizerParamScheduler's formulas (WSD: stable at the peak until the last
`wsd_decay_steps` of the decay span, then exponential (2 x 0.5^r - 1), linear, cosine or minus_sqrt (1 - sqrt r)
in the fraction r of them done; inverse-square-root: peak x sqrt(warm-up / step), floored at min-lr).

One schedule serves every param group, as Megatron's OptimizerParamScheduler does: a group with its own peak
and floor (--decoupled-lr / --decoupled-min-lr for the embedding and output layer) asks `lr(max_lr=, min_lr=)`
and follows the same warm-up and decay shape between them."""
from __future__ import annotations

import math
from typing import Optional


DECAY_STYLES = ("constant", "linear", "cosine", "WSD", "inverse-square-root")
WSD_DECAY_STYLES = ("exponential", "linear", "cosine", "minus_sqrt")


class LRSchedule:
    def __init__(self, max_lr: float, min_lr: float = 0.0, warmup_steps: int = 0,
                 decay_steps: int = 0, decay_style: str = "linear", num_steps: int = 0,
                 wsd_decay_steps: Optional[int] = None, wsd_decay_style: str = "exponential",
                 train_steps: Optional[int] = None):
        if decay_style not in DECAY_STYLES:
            raise ValueError(f"lr decay style {decay_style!r} must be one of {', '.join(DECAY_STYLES)}")
        if decay_style == "WSD" and (wsd_decay_steps is None or wsd_decay_style not in WSD_DECAY_STYLES):
            raise ValueError(f"WSD needs its decay steps and one of {', '.join(WSD_DECAY_STYLES)}")
        self.wsd_decay_steps, self.wsd_decay_style = wsd_decay_steps, wsd_decay_style
        self.max_lr, self.min_lr = float(max_lr), float(min_lr)
        # warm-up may be fractional (--lr-warmup-fraction x decay: Megatron-LM keeps the product, not its floor)
        self.warmup_steps = warmup_steps if isinstance(warmup_steps, float) else int(warmup_steps)
        self.decay_steps = int(decay_steps)
        self.decay_style = decay_style
        self.num_steps = int(num_steps)
        # the run's length in the schedule's unit, saved as Megatron's wd_incr_steps (train iters x global batch,
        # or train samples) so that a resume checks --train-iters as Megatron-LM does (training/schedule_resume.py)
        self.train_steps = None if train_steps is None else int(train_steps)

    def lr(self, step: int = None, max_lr: Optional[float] = None, min_lr: Optional[float] = None) -> float:
        """The learning rate for the optimizer step that follows `step` completed steps (of a group whose peak
        and floor are `max_lr` and `min_lr`; default the schedule's)."""
        n = self.num_steps if step is None else step
        top = self.max_lr if max_lr is None else float(max_lr)
        floor = self.min_lr if min_lr is None else float(min_lr)
        if self.warmup_steps > 0 and n <= self.warmup_steps:
            return top * n / self.warmup_steps
        if self.decay_style == "constant":
            return top
        if n > self.decay_steps:
            return floor
        if self.decay_style == "inverse-square-root":
            return max(floor, top * max(self.warmup_steps, 1) ** 0.5 / max(n, 1) ** 0.5)
        span = self.decay_steps - self.warmup_steps
        ratio = (n - self.warmup_steps) / span if span > 0 else 1.0
        if self.decay_style == "linear":
            coeff = 1.0 - ratio
        elif self.decay_style == "cosine":
            coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
        else:  # WSD
            anneal_start = self.decay_steps - self.wsd_decay_steps
            if n <= anneal_start:
                coeff = 1.0
            else:
                r = (n - anneal_start) / self.wsd_decay_steps
                coeff = {"linear": 1.0 - r, "cosine": 0.5 * (math.cos(math.pi * r) + 1.0),
                         "exponential": 2.0 * 0.5 ** r - 1.0, "minus_sqrt": 1.0 - math.sqrt(r)}[self.wsd_decay_style]
        return floor + coeff * (top - floor)

    def step(self, increment: int = 1) -> float:
        self.num_steps += increment
        return self.lr()

    def state_dict(self) -> dict:
        # Megatron's OptimizerParamScheduler keys, so its tools recognise them.
        return {"max_lr": self.max_lr, "min_lr": self.min_lr, "lr_warmup_steps": self.warmup_steps,
                "lr_decay_steps": self.decay_steps, "lr_decay_style": self.decay_style,
                "num_steps": self.num_steps, "wd_incr_steps": self.train_steps}

    def load_state_dict(self, state: dict):
        self.num_steps = int(state["num_steps"])


DEEPSPEED_STYLES = {"WarmupLR": "constant", "WarmupDecayLR": "linear", "WarmupCosineLR": "cosine"}


class DeepSpeedWarmupSchedule(LRSchedule):
    """DeepSpeed's WarmupLR / WarmupDecayLR / WarmupCosineLR (deepspeed/runtime/lr_schedules.py), value for value.

    They map onto the schedule above as constant / linear / cosine decay after a warm-up
    that starts at warmup_min_lr (log or linear in the step). DeepSpeed builds its scheduler
    at iteration -1 and steps it after each optimizer step, so the lr of the step after n
    completed steps is its formula at iteration n - 1 (the first step runs at warmup_min_lr,
    or at 0 for WarmupCosineLR). `params` are the JSON's scheduler.params; `lr` is the
    optimizer's lr (the peak unless warmup_max_lr says otherwise).
    """

    def __init__(self, kind: str, params: dict, lr: float, train_iters: int, num_steps: int = 0):
        p = dict(params)
        total = p.get("total_num_steps", 0)
        self.kind = kind
        self.total_num_steps = train_iters if total == "auto" else int(total)
        self.warmup_type = p.get("warmup_type", "log")
        warmup = max(2, int(p.get("warmup_num_steps", 1000)))
        self.inverse_log_warm_up = 1.0 / math.log(warmup)
        if kind == "WarmupCosineLR":
            self.warmup_min_ratio = float(p.get("warmup_min_ratio", 0.0))
            self.cos_min_ratio = float(p.get("cos_min_ratio", 0.0001))
            peak, floor = float(lr), float(lr) * self.cos_min_ratio
        else:
            peak = float(p.get("warmup_max_lr", lr if kind == "WarmupLR" else 0.001))
            floor = float(p.get("warmup_min_lr", 0.0))
        super().__init__(peak, floor, warmup, self.total_num_steps, DEEPSPEED_STYLES[kind], num_steps,
                         train_steps=train_iters)

    def _warmup_gamma(self, t: int) -> float:
        if self.warmup_type == "log":
            return self.inverse_log_warm_up * math.log(t + 1)
        return t / self.warmup_steps

    def lr(self, step: Optional[int] = None) -> float:
        t = (self.num_steps if step is None else step) - 1  # DeepSpeed's last_batch_iteration
        w, total = self.warmup_steps, self.total_num_steps
        if self.kind == "WarmupCosineLR":
            if t < 0:
                return 0.0
            if t < w:
                ratio = self.warmup_min_ratio + self._warmup_gamma(t) * (1. - self.warmup_min_ratio)
            else:
                progress = min(1.0, (t - w + 1) / max(1, total - w))
                ratio = max(0.0, self.cos_min_ratio + (1. - self.cos_min_ratio) * ((1 + math.cos(math.pi * progress)) / 2))
            return self.max_lr * ratio
        if t < 0:
            return self.min_lr
        if t < w:
            gamma = self._warmup_gamma(t)
        elif self.kind == "WarmupLR":
            gamma = 1.0
        else:
            gamma = max(0.0, float(total - t) / float(max(1.0, total - w)))
        return self.min_lr + (self.max_lr - self.min_lr) * gamma


def build_lr_schedule(sections) -> LRSchedule:
    """The schedule the checked configuration (config.Config) describes: Megatron's, or the DeepSpeed JSON's
    `scheduler`."""
    opt, run, units = sections.optimizer, sections.training, sections.compat
    ds = opt.deepspeed_scheduler
    if ds is not None:
        return DeepSpeedWarmupSchedule(ds["type"], ds["params"], opt.lr, run.train_iters)
    # the unit (iterations, samples or tokens) and its lengths come from config/compat.py's _schedule_units
    samples = units.lr_schedule_unit == "samples" and run.train_samples is not None
    train = run.train_samples if samples else run.train_iters * units.lr_schedule_per_step
    return LRSchedule(opt.lr, opt.min_lr, units.lr_schedule_warmup, units.lr_schedule_decay, run.lr_decay_style,
                      wsd_decay_steps=units.lr_schedule_wsd_decay, wsd_decay_style=run.lr_wsd_decay_style,
                      train_steps=train)


def decoupled_lr(schedule: LRSchedule, opt) -> Optional[float]:
    """The embedding and output layer's learning rate for the next step (--decoupled-lr, between it and
    --decoupled-min-lr, whose default is --min-lr as Megatron's), or None without --decoupled-lr. `opt`: the
    OptimizerConfig."""
    if opt.decoupled_lr is None:
        return None
    floor = opt.min_lr if opt.decoupled_min_lr is None else opt.decoupled_min_lr
    return schedule.lr(max_lr=opt.decoupled_lr, min_lr=floor)
