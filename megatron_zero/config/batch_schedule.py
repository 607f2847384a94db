"""The global batch size of every iteration: constant, Megatron-LM's --rampup-batch-size, or --step-batch-size-schedule.

The size is a function of the samples consumed before the iteration, computed as Megatron's
num-microbatches calculators do (megatron/core/num_microbatches_calculator.py):

| flag | global batch size at `consumed` samples |
|---|---|
| (none) | --global-batch-size G |
| --rampup-batch-size S I R | G once consumed > R; else S + int(consumed / (R / ((G - S) / I))) x I |
| --step-batch-size-schedule "T0:B0 T1:B1 ..." | B_k of the last entry with consumed >= T_k; T in tokens (K/M/B/T suffixes), // --seq-length |

The micro-batches of a step are that size / (--micro-batch-size x DP). A resume continues from the
consumed samples its checkpoint saved, so it runs at the batch size the uninterrupted run would.
Pure host arithmetic (no torch): the trainer, the sampler, the learning-rate schedule and the log all
read it without waiting on the device. It owns no training state.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Optional, Tuple

_SUFFIX = {"K": 10 ** 3, "M": 10 ** 6, "B": 10 ** 9, "T": 10 ** 12}


class BatchScheduleError(ValueError):
    """A batch-size schedule that cannot work (one sentence)."""


@dataclass(frozen=True)
class BatchSchedule:
    final: int  # --global-batch-size: the size after any ramp-up
    micro_batch_size: int
    data_parallel_size: int
    rampup: Optional[Tuple[int, int, int]] = None  # (start, increment, ramp-up samples)
    steps: Optional[Tuple[Tuple[int, int], ...]] = None  # (threshold in samples, batch size), ascending

    @property
    def varies(self) -> bool:
        return self.rampup is not None or self.steps is not None

    def global_batch_size(self, consumed: int) -> int:
        """The global batch of the iteration that starts after `consumed` samples."""
        if self.rampup is not None:
            start, increment, samples = self.rampup
            if consumed > samples:
                return self.final
            per_increment = samples / ((self.final - start) // increment)  # a float, as Megatron's
            return start + int(consumed / per_increment) * increment
        if self.steps is not None:
            size = self.steps[0][1]
            for threshold, batch in self.steps:
                if consumed < threshold:
                    break
                size = batch
            return size
        return self.final

    def num_micro_batches(self, consumed: int) -> int:
        return self.global_batch_size(consumed) // (self.micro_batch_size * self.data_parallel_size)

    def sizes(self, consumed: int, iterations: int) -> Iterator[int]:
        """The global batch of each of `iterations` iterations from `consumed` samples on."""
        for _ in range(iterations):
            size = self.global_batch_size(consumed)
            yield size
            consumed += size

    def reached(self, iterations: int, consumed: int = 0) -> set:
        """The global batch sizes `iterations` iterations from `consumed` samples take (walked until it is final)."""
        found = set()
        for _ in range(iterations):
            size = self.global_batch_size(consumed)
            found.add(size)
            if size == self.final and (self.rampup is None or consumed > self.rampup[2]):
                break  # constant from here on (the schedule never shrinks)
            consumed += size
        return found

    def consumed_after(self, iterations: int, consumed: int = 0) -> int:
        """Samples consumed after `iterations` more iterations from `consumed`."""
        for _ in range(iterations):
            size = self.global_batch_size(consumed)
            if size == self.final and (self.rampup is None or consumed > self.rampup[2]):
                return consumed + size * iterations
            consumed, iterations = consumed + size, iterations - 1
        return consumed

    def train_iters(self, train_samples: int) -> int:
        """Iterations of a --train-samples run, as Megatron's update_train_iters counts them."""
        iterations, consumed = 0, 0
        if self.rampup is not None:  # ramp-up, then whole final batches (a partial last one is dropped)
            while consumed <= self.rampup[2] and consumed <= train_samples:
                consumed += self.global_batch_size(consumed)
                iterations += 1
            return iterations + max(0, train_samples - consumed) // self.final
        if self.steps is not None:
            while consumed < train_samples:
                size = self.global_batch_size(consumed)
                if size == self.final:
                    return iterations + -(-(train_samples - consumed) // size)
                consumed += size
                iterations += 1
            return iterations
        return train_samples // self.final  # Megatron-LM's: a partial last batch is dropped


def _count(text: str, flag: str) -> int:
    """'2.4B' -> 2400000000 (Megatron's K/M/B/T suffixes)."""
    body = text.strip().upper()
    scale = _SUFFIX.get(body[-1:], 1)
    try:
        value = float(body[:-1] if scale > 1 else body)
    except ValueError:
        raise BatchScheduleError(f"{flag} entry value {text!r} is not a number (K, M, B, T suffixes allowed)") from None
    return int(value * scale)


def parse_step_schedule(text: str, seq_length: int) -> Tuple[Tuple[int, int], ...]:
    """'0:16 2.4B:320' -> ((0, 16), (2.4e9 // seq_length, 320)): thresholds in tokens, turned into samples."""
    flag, entries = "--step-batch-size-schedule", []
    for entry in text.replace(",", " ").split():
        if ":" not in entry:
            raise BatchScheduleError(f"{flag} entry {entry!r} is not THRESHOLD:BATCH_SIZE (e.g. \"0:16 2.4B:320\")")
        threshold, batch = entry.split(":", 1)
        entries.append((_count(threshold, flag) // seq_length, _count(batch, flag)))
    entries.sort(key=lambda e: e[0])
    if not entries or entries[0][0] != 0:
        raise BatchScheduleError(f"{flag} {text!r} must start with an entry at threshold 0 (the first batch size)")
    for (t0, b0), (t1, b1) in zip(entries, entries[1:]):
        if t1 <= t0:
            raise BatchScheduleError(f"{flag} {text!r}: thresholds must be strictly increasing in samples (tokens // "
                                     f"--seq-length {seq_length}), but two entries fall at sample {t0}")
        if b1 < b0:
            raise BatchScheduleError(f"{flag} {text!r}: the batch size must not shrink during training ({b0} then "
                                     f"{b1}), as Megatron-LM requires")
    if entries[0][1] <= 0:
        raise BatchScheduleError(f"{flag} {text!r}: batch sizes must be positive")
    return tuple(entries)


def schedule_from_args(args, dp: int) -> BatchSchedule:
    """The schedule --rampup-batch-size / --step-batch-size-schedule describe (constant without them);
    sets args.global_batch_size to the schedule's final size when it was not given."""
    ramp, step, mb = args.rampup_batch_size, args.step_batch_size_schedule, args.micro_batch_size
    if isinstance(step, list):  # several words: the entries, split by the shell
        step = " ".join(step)
    if ramp is not None and step is not None:
        raise BatchScheduleError("--rampup-batch-size and --step-batch-size-schedule both say how the global batch "
                                 "grows; give one of them")
    if step is not None:
        steps = parse_step_schedule(step, args.seq_length)
        last = steps[-1][1]
        if args.global_batch_size is not None and args.global_batch_size != last:
            raise BatchScheduleError(f"--global-batch-size {args.global_batch_size} differs from the last batch size "
                                     f"{last} of --step-batch-size-schedule; drop it or make them equal")
        args.global_batch_size = last
        return BatchSchedule(last, mb, dp, steps=steps)
    if ramp is None:
        return BatchSchedule(args.global_batch_size, mb, dp)
    start, increment, samples = ramp
    flag = f"--rampup-batch-size {start} {increment} {samples}"
    if args.train_samples is None:
        raise BatchScheduleError(f"{flag} ramps a sample-based run, as in Megatron-LM; give --train-samples (and "
                                 "--lr-*-samples) instead of --train-iters")
    if start <= 0 or increment <= 0 or samples <= 0:
        raise BatchScheduleError(f"{flag}: the start batch size, the increment and the ramp-up samples must be "
                                 "positive")
    final = args.global_batch_size
    if final is None or start >= final or (final - start) % increment:
        raise BatchScheduleError(f"{flag}: the increment must divide --global-batch-size {final} minus the start "
                                 f"batch size {start}, which must be smaller than it")
    return BatchSchedule(final, mb, dp, rampup=(start, increment, samples))


def check_reachable(schedule: BatchSchedule, train_iters: int, pp: int, interleaved: bool) -> None:
    """Every global batch a run of `train_iters` iterations reaches: a multiple of micro-batch x DP, and enough
    micro-batches to fill the pipeline (a multiple of PP for the interleaved schedule)."""
    unit = schedule.micro_batch_size * schedule.data_parallel_size
    flag = "--rampup-batch-size" if schedule.rampup is not None else "--step-batch-size-schedule"
    for size in sorted(schedule.reached(train_iters)):
        if size % unit:
            raise BatchScheduleError(
                f"{flag} reaches a global batch of {size}, not a multiple of --micro-batch-size "
                f"{schedule.micro_batch_size} x data-parallel size {schedule.data_parallel_size}; every batch size "
                "it reaches must be")
        m = size // unit
        if pp > 1 and (m < pp or (interleaved and m % pp)):
            need = "a multiple of" if interleaved else "at least"
            raise BatchScheduleError(
                f"{flag} reaches a global batch of {size}, {m} micro-batches per step, where "
                f"--pipeline-model-parallel-size {pp} needs {need} {pp}")
