"""What Megatron does around a training step besides training: garbage collection by hand (--manual-gc),
returning cached device memory (--empty-unused-memory-level) and a torch.profiler trace (--profile).

training.py calls `after_forward_backward()`, `after_step(iteration)`, `before_eval_or_save()` and
`close()`; each does nothing unless its flag asks.
"""
from __future__ import annotations

import gc
import os

import torch


class StepHooks:
    def __init__(self, args, device: torch.device, rank: int):
        self.device = device
        self.gc_interval = args.manual_gc_interval if args.manual_gc else None
        self.empty_level = args.empty_unused_memory_level
        if self.gc_interval is not None:  # every rank collects at the same iterations: no straggler
            gc.disable()
            gc.collect()
        self.profile = args.profile and rank in args.profile_ranks
        self.start, self.end = args.profile_step_start, args.profile_step_end
        self.trace_dir = args.tensorboard_dir
        # operator input shapes, except under FP8: with torchao's float8 tensors torch.profiler's record_shapes
        # crashed the rank (SIGSEGV) in 3 of 7 CPU runs of the FP8 launch script, in none of 10 without it
        self.record_shapes = not getattr(args, "fp8_format", None)
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
                activities=activities, record_shapes=self.record_shapes,
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
        self.profiler.stop()
        self.profiler, self.profile = None, False

    def close(self):
        if self.profiler is not None:
            self._stop_profiler()
        if self.gc_interval is not None:
            gc.enable()
