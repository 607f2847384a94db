"""The re-run machine (--rerun-mode): each step's results checked, a failed check attributed by re-running the
step from the same state, and the run healed in-process.

    machine = RerunMachine(rerun_config, check_nan, dynamic_loss_scale, seed, rank, world_size, device, hosts)
    machine.skips(iteration)                         # --iterations-to-skip and the tracker file's (1-based)
    outcome = machine.run_step(iteration, attempt)   # attempt(riders, gate) runs the step once
    outcome.accepted / outcome.rejected (a reason)   # ResultFault raised for a persistent fault

What a step's results are: the global batch's loss as each rank holds it (rank r's copy in slot r of a vector
that rides in the gradient norm's all-reduce, ZeroOptimizer.step(riders=...)) and the gradient norm. The
all-reduce brings every rank every rank's copy; the one host read the step already makes (the norm, for
clipping) brings them to the host: no read of their own. The optimizer's `gate` sees them before anything
is updated, so a step that fails is not applied and nothing needs restoring but the random-number states
(the weights, optimizer state and loss scale are untouched; the data are the same micro-batches).

    first run ── checks pass ──────────────────────────────────────────────► applied
        │ a check fails (NaN/Inf, spike, large gradients, or one rank's copy differs from the others')
        ▼ re-run from the same state (random-number states restored)
    re-run ── its results differ from the first run's ── and pass ────────► transient fault: the re-run's
        │                                                                  result applied, counted per rank
        │ the same results, bit for bit (steps are deterministic here)
        ├── every rank holds the same copy ─► genuine anomaly (the data): rejected, the random-number states
        │                                     restored, the global batch skipped as --iterations-to-skip skips
        │                                     it, a tracker line; more than MAX_REJECTED in WINDOW stops the run
        └── one rank's copy differs ────────► persistent fault on that rank: ResultFault (exit 17), one line
                                              naming rank and host, nothing saved after it
report_stats runs every step twice and records the differences (zero here by design on the CPU).
"""
from __future__ import annotations

import math
import os
import struct
from collections import Counter, deque
from dataclasses import dataclass
from typing import Callable, List, Optional

import torch

from ..tensor_parallel.rng_state import get_rng_state, set_rng_state
from . import tracker
from .injection import ErrorInjector
from .validation import ResultChecks

EXIT_FAULTY_RANK = 17  # Megatron-LM's EXIT_CODE_FAILED_ON_RESULT_VALIDATION
MAX_REJECTED, WINDOW = 5, 100  # more than 5 steps rejected within 100 iterations stop the run


class ResultFault(Exception):
    """A rank computes wrong results reproducibly: one line naming it; the run exits EXIT_FAULTY_RANK."""
    exit_code = EXIT_FAULTY_RANK


class TooManyRejected(Exception):
    """Rejected steps come too often to skip them: one sentence (exit 2)."""


@dataclass
class StepOutcome:
    result: tuple  # train_step's (loss, lr, updated, grad_norm) of the run whose update was decided
    rejected: Optional[str] = None  # why the step was rejected (its batch skipped), or None


def _bits(x: float) -> bytes:
    return struct.pack("<d", x)


class RerunMachine:
    def __init__(self, cfg, check_nan: bool, dynamic_loss_scale: bool, seed: int, rank: int, world_size: int,
                 device: torch.device, hosts: List[str]):
        self.mode, self.rank, self.world_size, self.device, self.hosts = (cfg.rerun_mode, rank, world_size, device,
                                                                          hosts)
        self.checks = ResultChecks(check_nan, cfg.check_for_spiky_loss, cfg.check_for_large_grads,
                                   cfg.spiky_loss_factor, cfg.large_grads_factor, cfg.result_window,
                                   dynamic_loss_scale)
        self.injector = ErrorInjector(cfg.error_injection_rate, cfg.error_injection_type, seed, world_size)
        self.tracker_file = cfg.result_rejected_tracker_filename
        from_file = tracker.iterations_to_skip(self.tracker_file) if self.tracker_file else []
        self.to_skip = set(cfg.iterations_to_skip) | set(from_file)
        self.counts: Counter = Counter()  # outcome -> steps (transient, rejected, skipped, ...)
        self.transient_by_rank: Counter = Counter()
        self.rejected_at: deque = deque()
        self.differences: List[float] = []  # report_stats: |first - re-run| of the loss and the norm, per step
        self._first = None  # (norm, overflow, copies) of the first run, when it failed a check
        self._failing: List[int] = []  # the ranks whose first-run results failed
        self._why: Optional[str] = None
        self.iteration = 0  # the step being run (1-based)
        self._verdict = None

    @property
    def enabled(self) -> bool:
        return self.mode != "disabled"

    def skips(self, iteration: int) -> bool:
        return iteration in self.to_skip

    # ---- one step ------------------------------------------------------------------------------------------
    def run_step(self, iteration: int, attempt: Callable) -> StepOutcome:
        """Run the step through `attempt(riders, gate)` (train_step) once, or twice when its first results fail a
        check or when reporting statistics; decide what it becomes."""
        rng = get_rng_state()
        self._first, self._why, self.iteration = None, None, iteration
        result = attempt(lambda loss: self._riders(loss, 0), lambda *r: self._gate(0, *r))
        if self._verdict == "accept":
            return StepOutcome(result)
        self._restore(rng)
        result = attempt(lambda loss: self._riders(loss, 1), lambda *r: self._gate(1, *r))
        if self._verdict == "accept":
            return StepOutcome(result)
        if self._verdict == "persistent":
            raise ResultFault(self._fault_line())
        if self._verdict == "unsettled":
            raise ResultFault(f"the results of iteration {iteration} differ on every run ({self._why}): the "
                              f"computation cannot be trusted on {self._ranks_text(self._failing)}")
        self._restore(rng)  # rejected: as though the step had never run
        self._count_rejection(iteration)
        return StepOutcome(result, rejected=self._why)

    def _restore(self, rng) -> None:
        from ..moe import reset_aux_losses  # a re-run's MoE losses replace the first run's

        set_rng_state(rng)
        reset_aux_losses()

    def _riders(self, loss: torch.Tensor, attempt: int) -> torch.Tensor:
        """This rank's copy of the step's loss in its slot (the others zero), NaN where an error is injected."""
        copies = torch.zeros(self.world_size, dtype=torch.float64, device=loss.device)
        copies[self.rank] = loss.reshape(()).double()
        if self.injector.corrupts(self.iteration, self.rank, attempt):
            copies[self.rank] = float("nan")
        return copies

    def _failures(self, norm: float, overflow: bool, copies: List[float]) -> List[str]:
        """Per rank: what its copy of the results fails, or '' (a copy that passes the checks but differs from
        the most common passing copy fails too)."""
        checked = [self.checks.failure(c, norm, overflow) or "" for c in copies]
        passing = [_bits(c) for c, why in zip(copies, checked) if not why] or [_bits(c) for c in copies]
        common = Counter(passing).most_common(1)[0][0]
        return [why or ("its copy of the loss differs from the other ranks'" if _bits(c) != common else "")
                for c, why in zip(copies, checked)]

    def _gate(self, attempt: int, norm: float, overflow: bool, copies: List[float]) -> bool:
        """ZeroOptimizer.step's gate: whether this run's update is applied (sets self._verdict)."""
        copies = copies[:self.world_size]
        failures = self._failures(norm, overflow, copies)
        if self.mode == "report_stats":
            if attempt == 0:
                self._first = (norm, overflow, copies)
                self._verdict = "rerun"
                return False
            loss_diff = max(abs(a - b) if math.isfinite(a - b) else 0.0 for a, b in zip(self._first[2], copies))
            norm_diff = abs(norm - self._first[0]) if math.isfinite(norm - self._first[0]) else 0.0
            self.differences.append(max(loss_diff, norm_diff))
            self.counts["re-run"] += 1
            self._verdict = "accept"
            return True
        if attempt == 0:
            if not any(failures):
                self.checks.accept(copies[0], norm)
                self._verdict = "accept"
                return True
            self._first, self._failing = (norm, overflow, copies), [r for r, f in enumerate(failures) if f]
            self._why = failures[self._failing[0]]
            self._write(tracker.INITIAL_RUN, copies)
            self._verdict = "rerun"
            return False
        same = _bits(norm) == _bits(self._first[0]) and [_bits(c) for c in copies] == [_bits(c) for c in
                                                                                          self._first[2]]
        if not same:
            self._write(tracker.FIRST_RERUN_NOT_REPRODUCIBLE, copies)
            if any(failures):
                self._verdict = "unsettled"
                return False
            self.counts["transient"] += 1
            for r in self._failing:
                self.transient_by_rank[r] += 1
            self.checks.accept(copies[0], norm)
            self._verdict = "accept"
            return True
        self._write(tracker.FIRST_RERUN_REPRODUCIBLE, copies)
        everywhere = len({_bits(c) for c in copies}) == 1
        self._write(tracker.SECOND_RERUN_REPRODUCIBLE if everywhere else tracker.SECOND_RERUN_NOT_REPRODUCIBLE,
                    copies)
        self._verdict = "reject" if everywhere else "persistent"
        return False

    # ---- reporting -----------------------------------------------------------------------------------------
    def _write(self, status: str, copies: List[float]) -> None:
        """A tracker line, from the first rank whose results failed (as Megatron-LM: the rank that found it)."""
        if not self.tracker_file or self.rank != self._failing[0]:
            return
        where = "cpu" if self.device.type == "cpu" else str(self.device.index or 0)
        tracker.append_lines(self.tracker_file, [tracker.tracker_line(self.rank, where, self.iteration, status,
                                                                      copies[self.rank], self._why)])

    def _ranks_text(self, ranks: List[int]) -> str:
        return ", ".join(f"rank {r} ({self.hosts[r]})" for r in ranks)

    def _fault_line(self) -> str:
        return (f"{self._ranks_text(self._failing)} computed a wrong result at iteration {self.iteration} twice "
                f"({self._why}) where the other ranks did not: a persistent fault; exclude "
                f"{'that host' if len(self._failing) == 1 else 'those hosts'} and resume from the last checkpoint "
                f"(exit {EXIT_FAULTY_RANK})")

    def _count_rejection(self, iteration: int) -> None:
        self.counts["rejected"] += 1
        self.rejected_at.append(iteration)
        while self.rejected_at and self.rejected_at[0] <= iteration - WINDOW:
            self.rejected_at.popleft()
        if len(self.rejected_at) > MAX_REJECTED:
            raise TooManyRejected(
                f"{len(self.rejected_at)} steps were rejected within {WINDOW} iterations (the last at iteration "
                f"{iteration}: {self._why}): more than {MAX_REJECTED} is not bad data but a run that cannot go on")

    def rejection_line(self, iteration: int, samples: int, why: str) -> str:
        return (f"iteration {iteration} rejected ({why}, reproduced on re-run by every rank): its global batch of "
                f"{samples} samples skipped, the state before it kept"
                + (f"; recorded in {self.tracker_file}" if self.tracker_file else ""))

    def summary(self) -> Optional[str]:
        """The end-of-run line: faults by kind (None where the machine is off)."""
        if not self.enabled:
            return None
        if self.mode == "report_stats":
            d = self.differences
            nonzero = sum(1 for x in d if x != 0.0)
            return (f"re-run statistics: {len(d)} steps run twice; differences between the runs (loss and gradient "
                    f"norm): max {max(d, default=0.0):.3e}, mean {sum(d) / max(1, len(d)):.3e}, {nonzero} nonzero")
        by_rank = ", ".join(f"rank {r} ({self.hosts[r]}): {n}" for r, n in sorted(self.transient_by_rank.items()))
        return (f"result validation: {self.counts['transient']} transient faults"
                + (f" ({by_rank})" if by_rank else "") + f", {self.counts['rejected']} steps rejected as genuine "
                f"anomalies, {self.counts['skipped']} iterations skipped as asked, 0 persistent faults")


def hostnames(world_size: int) -> List[str]:
    """Every rank's host name (one all-gather at start-up, where the machine is on)."""
    import torch.distributed as dist

    names = [os.uname()[1]] * world_size
    if world_size > 1:
        dist.all_gather_object(names, os.uname()[1])
    return names
