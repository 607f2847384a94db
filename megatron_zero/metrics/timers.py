"""Megatron's named timers: where an iteration's time goes, reported every --log-interval.

`Timers(level, option, device)` hands out a `Timer` per name; a timer whose level is above
`--timing-log-level` is a no-op (level 0 reports nothing, as Megatron). A running timer waits for
the device's queued work at start and stop, so on an accelerator it measures the work, not its
launch. `report()` is a collective over the world (every rank calls it at the same iteration): it
gathers each timer's time since the last report and formats Megatron's line,

    (min, max) time across ranks (ms):
        forward-compute ...............................: (12.31, 14.02)

`--timing-log-option` chooses max, minmax or all (one value per rank). The names the training loop
uses, at their Megatron levels:

| level | timer                   | what it covers                                                     |
|-------|-------------------------|--------------------------------------------------------------------|
| 0     | (none)                  |                                                                    |
| 1     | forward-backward        | the pipeline schedule over all micro-batches                       |
| 1     | optimizer               | ZeRO step: reduction of the last buckets, clip, Adam, weight gather|
| 2     | forward-compute         | the stage's forward, summed over micro-batches                     |
| 2     | backward-compute        | forward-backward minus forward-compute and pipeline-p2p            |
| 2     | pipeline-p2p            | sends/receives between pipeline stages (communication)             |
| 2     | embedding-grads-all-reduce | tied-embedding gradient sum over first/last stage (communication)|
| 2     | loss-broadcast          | the loss to every rank (communication)                             |

ZeRO-2/3's bucketed gradient reduce-scatter runs inside backward hooks and counts in
backward-compute; what is left of it at the end counts in optimizer.
"""
from __future__ import annotations

import time
from typing import Dict

import torch
import torch.distributed as dist

TIMING_OPTIONS = ("max", "minmax", "all")


def _synchronize(device: torch.device):
    if device.type != "cpu":
        torch.get_device_module(device).synchronize(device)


class Timer:
    def __init__(self, device: torch.device):
        self.device = device
        self.elapsed_s = 0.0
        self._started = None

    def start(self):
        _synchronize(self.device)
        self._started = time.perf_counter()

    def stop(self):
        _synchronize(self.device)
        self.elapsed_s += time.perf_counter() - self._started
        self._started = None

    def add(self, seconds: float):
        self.elapsed_s += seconds

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc):
        self.stop()


class _NullTimer:
    elapsed_s = 0.0

    def start(self):
        pass

    def stop(self):
        pass

    def add(self, seconds: float):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass


_NULL = _NullTimer()


class TimedCalls:
    """`obj` whose every method call adds to `timer` (the pipeline's P2P, timed as communication)."""

    def __init__(self, obj, timer):
        self._obj, self._timer = obj, timer

    def __getattr__(self, name):
        attr = getattr(self._obj, name)
        if not callable(attr):
            return attr

        def call(*args, **kwargs):
            with self._timer:
                return attr(*args, **kwargs)
        return call


class Timers:
    def __init__(self, log_level: int, log_option: str, device: torch.device):
        self.log_level, self.log_option, self.device = log_level, log_option, device
        self._timers: Dict[str, Timer] = {}

    def __call__(self, name: str, level: int):
        """The timer `name`, or a no-op one when `level` is above --timing-log-level."""
        if level > self.log_level:
            return _NULL
        if name not in self._timers:
            self._timers[name] = Timer(self.device)
        return self._timers[name]

    def timed(self, fn, name: str, level: int):
        """`fn` wrapped so that each call adds to timer `name`."""
        timer = self(name, level)
        if timer is _NULL:
            return fn

        def call(*args, **kwargs):
            with timer:
                return fn(*args, **kwargs)
        return call

    def elapsed_ms(self) -> Dict[str, float]:
        """{name: milliseconds since the last reset}, then reset."""
        out = {name: t.elapsed_s * 1e3 for name, t in self._timers.items()}
        for t in self._timers.values():
            t.elapsed_s = 0.0
        return out

    def report(self, normalizer: int = 1) -> tuple:
        """(Megatron's text block or '', {name: max ms across ranks}), per iteration (divided by `normalizer`).

        Collective: every rank of the default group calls it at the same point.
        """
        mine = self.elapsed_ms()
        names = sorted(mine)
        if not names:
            return "", {}
        # on the device: the default group is NCCL's on a GPU, which gathers device tensors only
        local = torch.tensor([mine[n] / max(1, normalizer) for n in names], dtype=torch.float64, device=self.device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            flat = torch.empty(dist.get_world_size() * len(names), dtype=torch.float64, device=self.device)
            dist.all_gather_into_tensor(flat, local)
            table = flat.view(-1, len(names))  # [ranks, timers]
        else:
            table = local.unsqueeze(0)
        table = table.tolist()  # one read back to the host for the whole table
        header = {"max": "max time across ranks (ms):", "minmax": "(min, max) time across ranks (ms):",
                  "all": "times across ranks (ms):"}[self.log_option]
        lines = [header]
        for i, name in enumerate(names):
            col = [row[i] for row in table]
            if self.log_option == "max":
                value = f"{max(col):.2f}"
            elif self.log_option == "minmax":
                value = f"({min(col):.2f}, {max(col):.2f})"
            else:
                value = ", ".join(f"{v:.2f}" for v in col)
            lines.append(f"    {name} {'.' * max(1, 40 - len(name))}: {value}")
        return "\n".join(lines), {n: max(row[i] for row in table) for i, n in enumerate(names)}
