"""The per-rank compute-time report (--log-straggler): which ranks are slow, every --log-interval.

A rank's wall time per step says nothing: every collective waits for the slowest rank, so all ranks finish
each step together. What differs is the time a rank spends computing. As Megatron-LM's StragglerDetector, the
report times each micro-batch's forward step, the part of the step with no data-parallel collective in it:
on a GPU with CUDA events recorded on the compute stream around it (read back only at the log line, which
already waits for the step), on the CPU with a monotonic clock. A rank slow in its forward is slow in its
backward too (the same kernels on the same hardware), so the forward names it without timing the backward,
whose gradient reductions make fast ranks wait.

At each log line one all-gather of (forward seconds, on/off) per rank, and the writer rank prints one line:

     straggler report | forward compute per iteration (ms): slowest rank 1 (node7) 41.20, fastest rank 0
     (node3) 2.05, median 2.05 | over 1.5x the median: rank 1 (node7) 20.10x

`--straggler-minmax-count N` names the N slowest and N fastest; a rank is named as a straggler when its time
is over `--straggler-factor` times the median of the ranks in its pipeline stage (stages do different work;
the lower median for an even count, so of two ranks the faster is the yardstick). The process's first step
(allocation, lazy initialisation) is left out. Ranks that wait on each other inside the forward (tensor, context or expert parallelism,
ZeRO-3's weight gathers) share the slow rank's time, so the group shows slow together, as in Megatron-LM.

`--disable-straggler-on-startup` starts with the report off; with `--straggler-ctrlr-port P` rank 0 listens
on port P and each connection (e.g. `curl host:P`) turns the report on or off at the next log line (every rank
learns it in that line's all-gather).

    report = straggler_report(elastic, state, device)  # collective (the hosts); None without --log-straggler
    step = report.timed(forward_step)                 # per micro-batch
    line = report.line()                              # collective, at each log line
"""
from __future__ import annotations

import socket
import threading
import time
from typing import Callable, List, Optional

import torch
import torch.distributed as dist

from ..config.errors import ArgumentError


class _Clock:
    """Seconds spent inside timed calls since the last `read()`: CUDA events on a GPU, perf_counter on the CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.seconds, self.events = 0.0, []

    def timed(self, fn: Callable) -> Callable:
        def call(*args, **kwargs):
            if self.cuda:
                start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                out = fn(*args, **kwargs)
                stop.record()
                self.events.append((start, stop))
                return out
            begin = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - begin
        return call

    def read(self) -> float:
        if self.events:
            self.events[-1][1].synchronize()
            self.seconds += sum(a.elapsed_time(b) for a, b in self.events) / 1e3
            self.events = []
        seconds, self.seconds = self.seconds, 0.0
        return seconds


class _Toggle:
    """Rank 0's listener on --straggler-ctrlr-port: each connection asks to turn the report on or off."""

    def __init__(self, port: int):
        self.requested = False
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("0.0.0.0", port))
        self.sock.listen(16)
        threading.Thread(target=self._serve, name="megatron_zero-straggler-toggle", daemon=True).start()

    def _serve(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                self.requested = not self.requested
                body = b"the straggler report changes state at the next log line\n"
                conn.sendall(b"HTTP/1.0 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))

    def take(self) -> bool:
        asked, self.requested = self.requested, False
        return asked


class StragglerReport:
    def __init__(self, elastic, rank: int, world_size: int, device: torch.device, stages: List[int]):
        """`elastic`: the run's ElasticConfig (--straggler-*); `stages`: each rank's pipeline stage (ranks are
        compared with those doing the same work)."""
        self.rank, self.world, self.device, self.stages = rank, world_size, device, stages
        self.count, self.factor = elastic.straggler_minmax_count, elastic.straggler_factor
        self.on = not elastic.disable_straggler_on_startup
        self.clock, self.steps, self.timed_steps = _Clock(device), 0, 0
        self.hosts = [socket.gethostname()] * world_size
        if world_size > 1:
            dist.all_gather_object(self.hosts, socket.gethostname())
        self.toggle = None
        if rank == 0 and elastic.straggler_ctrlr_port:
            try:
                self.toggle = _Toggle(elastic.straggler_ctrlr_port)
            except OSError as err:
                raise ArgumentError(f"--straggler-ctrlr-port {elastic.straggler_ctrlr_port}: rank 0 cannot listen "
                                    f"on it ({err.strerror or err}); give a free port") from None

    def timed(self, forward_step: Callable) -> Callable:
        """This step's `forward_step` (called per micro-batch), timed while the report is on; the process's first
        step (allocation, lazy initialisation) is left out."""
        self.steps += 1
        if not self.on or self.steps == 1:
            return forward_step
        self.timed_steps += 1
        return self.clock.timed(forward_step)

    def line(self) -> Optional[str]:
        """Collective (every rank at the same log line): the report's line, a line saying it turned on or off,
        or None (off; or nothing timed yet)."""
        per_iteration = self.clock.read() / max(1, self.timed_steps)
        flip = float(self.toggle.take()) if self.toggle is not None else 0.0
        mine = torch.tensor([per_iteration, flip], dtype=torch.float64, device=self.device)
        if self.world > 1:
            table = torch.empty(self.world * 2, dtype=torch.float64, device=self.device)
            dist.all_gather_into_tensor(table, mine)
            table = table.view(self.world, 2).tolist()
        else:
            table = [mine.tolist()]
        was_on, timed, self.timed_steps = self.on, self.timed_steps, 0
        if table[0][1]:
            self.on = not self.on
        if not was_on:
            return " straggler report | on from the next iteration" if self.on else None
        if not timed:  # the first step alone (--log-interval 1), the same on every rank
            return " straggler report | off from the next iteration" if not self.on else None
        line = straggler_line([row[0] for row in table], self.hosts, self.stages, self.count, self.factor)
        return line + (" | off from the next iteration" if not self.on else "")


def straggler_report(elastic, state, device: torch.device) -> Optional[StragglerReport]:
    """The report of this rank (`state`: its ParallelState) when --log-straggler (ElasticConfig) asks for one."""
    if not elastic.log_straggler:
        return None
    size = state.layout.world_size
    return StragglerReport(elastic, state.rank, size, device, [state.layout.coords(r)[0] for r in range(size)])


def straggler_line(seconds: List[float], hosts: List[str], stages: List[int], count: int, factor: float) -> str:
    """The report's text from each rank's forward seconds per iteration (index: rank; `stages`: each rank's
    pipeline stage, whose ranks' median is its yardstick)."""
    def name(r):
        return f"rank {r} ({hosts[r]}) {seconds[r] * 1e3:.2f}"
    medians = {}
    for stage in sorted(set(stages)):
        times = sorted(seconds[r] for r in range(len(seconds)) if stages[r] == stage)
        medians[stage] = times[(len(times) - 1) // 2]  # the lower median
    order = sorted(range(len(seconds)), key=lambda r: seconds[r])
    n = min(count, max(1, len(order) // 2))
    median = (f"median {medians[0] * 1e3:.2f}" if len(medians) == 1 else
              "median per pipeline stage " + ", ".join(f"{m * 1e3:.2f}" for m in medians.values()))
    text = (f" straggler report | forward compute per iteration (ms): slowest {'' if n == 1 else f'{n}: '}"
            f"{', '.join(name(r) for r in reversed(order[-n:]))}, fastest {'' if n == 1 else f'{n}: '}"
            f"{', '.join(name(r) for r in order[:n])}, {median} | ")
    slow = [r for r in reversed(order) if medians[stages[r]] > 0 and seconds[r] > factor * medians[stages[r]]]
    if not slow:
        return text + f"no rank over {factor:g}x the median"
    return text + f"over {factor:g}x the median: " + ", ".join(
        f"rank {r} ({hosts[r]}) {seconds[r] / medians[stages[r]]:.2f}x" for r in slow)
