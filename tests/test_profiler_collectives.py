"""--profile with a collective in flight when the profiler stops (--overlap-param-gather leaves the step's
all-gathers running past it): StepHooks waits for them first (its `settle`, the optimizer's wait_params in
training/trainer.py).

Without that wait, torch.profiler (2.13) stopped while gloo's worker thread was finishing an all-gather that
started under it, and freeing that collective's handle afterwards killed the rank with SIGSEGV (in
~TorchOpStorage under ~AsyncWork), with record_shapes on or off and with no FP8 involved. It is a race: each
rank here stops a profiler CYCLES times, the peer joining the gather late by about the stop's duration; without
the wait 3 of 11 runs lost a rank (SIGSEGV, SIGABRT), with it none of 10.
"""
import argparse
import os
import time

import torch
import torch.distributed as dist

from megatron_zero.training.step_hooks import StepHooks
from megatron_zero.testing.multirank import run_ranks

CYCLES = 40


def _profiled_steps_with_a_gather_in_flight(trace_dir, cycles):
    rank = dist.get_rank()
    x = torch.randn(1 << 20)
    outs = [torch.empty_like(x) for _ in range(2)]
    done = []
    for cycle in range(cycles):
        compat = argparse.Namespace(manual_gc=False, manual_gc_interval=None, empty_unused_memory_level=0,
                                    profile=True, profile_ranks=[0, 1], profile_step_start=0, profile_step_end=1)
        in_flight = []
        hooks = StepHooks(compat, os.path.join(trace_dir, f"rank{rank}", f"cycle{cycle}"), torch.device("cpu"), rank,
                          settle=lambda: [w.wait() for w in in_flight])
        hooks.before_step(0)
        done.clear()  # the last cycle's handle freed under this cycle's profiler
        if rank == 1:
            time.sleep(0.02)  # the other rank stops its profiler about when gloo's thread finishes the gather
        in_flight.append(dist.all_gather(outs, x * 2, async_op=True))
        hooks.close()  # the run ends inside the profiled steps: the profiler stops
        assert hooks.profiler is None
        in_flight[0].wait()
        done.append(in_flight.pop())
    dist.barrier()
    return sum(f.endswith(".pt.trace.json") for _, _, files in os.walk(os.path.join(trace_dir, f"rank{rank}"))
               for f in files)


def test_profiler_stops_after_the_collectives_in_flight(tmp_path):
    assert run_ranks(_profiled_steps_with_a_gather_in_flight, 2, str(tmp_path), CYCLES, timeout=300) == \
        [CYCLES, CYCLES]
