"""What Megatron does around a training step besides training: garbage collection by hand (--manual-gc),
returning cached device memory (--empty-unused-memory-level) and a torch.profiler trace (--profile).

The profiler stops only once the collectives a step leaves in flight have finished (`settle`: the optimizer's
--overlap-param-gather all-gathers). A gloo collective started under the profiler carries the profiler's state to
gloo's worker thread; stopped while that thread was finishing it, torch.profiler (2.13) corrupted the state and the
rank died with SIGSEGV when the collective's handle was freed (~TorchOpStorage, under ~AsyncWork), with or without
record_shapes (tests/test_profiler_collectives.py).

training/trainer.py calls `after_forward_backward()`, `after_step(iteration)`, `before_eval_or_save()` and
`close()`; each does nothing unless its flag asks.
"""
from __future__ import annotations

import gc
import os
from typing import Callable, Optional

import torch


class StepHooks:
    def __init__(self, compat, trace_dir: Optional[str], device: torch.device, rank: int,
                 settle: Optional[Callable[[], None]] = None):
        """`compat`: the run's CompatConfig (--manual-gc*, --empty-unused-memory-level, --profile*); `trace_dir`:
        where the trace goes (--tensorboard-dir); `settle`: waits for the collectives a step leaves in flight
        (called before the profiler stops)."""
        self.device, self.settle = device, settle
        self.gc_interval = compat.manual_gc_interval if compat.manual_gc else None
        self.empty_level = compat.empty_unused_memory_level
        if self.gc_interval is not None:  # every rank collects at the same iterations: no straggler
            gc.disable()
            gc.collect()
        self.profile = compat.profile and rank in compat.profile_ranks
        self.start, self.end = compat.profile_step_start, compat.profile_step_end
        self.trace_dir = trace_dir
        self.profiler = None

    def _empty_cache(self):
        if self.device.type == "cuda":  # the CPU allocator keeps no cache to return
            torch.cuda.empty_cache()

    def before_step(self, iteration: int):
        """`iteration`: steps completed so far; the trace covers steps start+1 .. end (Megatron's)."""
        if self.profile and self.profiler is None and iteration == self.start:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            os.makedirs(self.trace_dir, exist_ok=True)
            self.profiler = torch.profiler.profile(
                activities=activities, record_shapes=True,
                on_trace_ready=torch.profiler.tensorboard_trace_handler(self.trace_dir))
            self.profiler.start()

    def after_forward_backward(self):
        if self.empty_level >= 2:
            self._empty_cache()

    def after_step(self, iteration: int):
        if self.empty_level >= 1:
            self._empty_cache()
        if self.gc_interval and iteration % self.gc_interval == 0:
            gc.collect()
        if self.profiler is not None:
            self.profiler.step()
            if iteration >= self.end:
                self._stop_profiler()

    def before_eval_or_save(self):
        if self.gc_interval is not None:
            gc.collect()

    def _stop_profiler(self):
        if self.settle is not None:
            self.settle()
        self.profiler.stop()
        self.profiler, self.profile = None, False

    def close(self):
        if self.profiler is not None:
            self._stop_profiler()
        if self.gc_interval is not None:
            gc.enable()
