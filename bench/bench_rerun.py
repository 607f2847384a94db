"""What result validation costs a step: --rerun-mode disabled vs validate_results (with the spike and large-gradient
checks) vs report_stats (every step run twice), pretrain_gpt.py as a user runs it.

    .venv/bin/python bench/bench_rerun.py [--rounds 3] [--iters 40] [--nproc 2]

Each round launches the three modes in turn, starting with another each round (so a busy machine slows them
alike): torchrun with
--nproc ranks (gloo, OMP_NUM_THREADS=1), the tiny 2-layer GPT of the command-line tests on byte-level text,
no fault injected. The time per step is the median of the log's `elapsed time per iteration` over the
iterations after the first five; the table gives each mode's median over the rounds, its ratio to disabled
measured in the same run, and the median (range) of its ratio to the disabled launch of the same round. A second
table gives CPU time per step over all ranks: the launch's CPU time (its processes' rusage) less that of a
5-iteration launch of the same mode, over the iterations between: on a machine shared with other jobs the wall
clock varies several-fold, CPU time far less.
"""
import argparse
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_zero.testing.cli import cli_flags, text_data  # noqa: E402
from megatron_zero.testing.launch import PRETRAIN  # noqa: E402
from megatron_zero.testing.multirank import free_port  # noqa: E402

SHORT = 5  # iterations of the launch whose CPU time is subtracted (start-up, building, the first steps)
MODES = {
    "disabled": {},
    "validate_results": {"rerun-mode": "validate_results", "check-for-spiky-loss": True,
                         "check-for-large-grads": True},
    "report_stats": {"rerun-mode": "report_stats"},
}


def step_ms(where: str, data: str, nproc: int, iters: int, mode: dict) -> tuple:
    """(median wall ms per step from the log, CPU seconds of the whole launch: every rank, start-up included)."""
    argv = cli_flags(data, os.path.join(where, "cache"), "gpt2", {"train-iters": iters}, mode)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
                          "--master_port", str(free_port()), PRETRAIN] + argv, capture_output=True, text=True,
                         timeout=900, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    times = [float(x) for x in re.findall(r"elapsed time per iteration \(ms\): ([0-9.]+)", run.stdout)]
    return statistics.median(times[5:]) if len(times) > 5 else None, cpu


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--iters", type=int, default=40)
    p.add_argument("--nproc", type=int, default=2)
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as where:
        data = text_data(os.path.join(where, "text"))
        ms, cpu = {name: [] for name in MODES}, {name: [] for name in MODES}
        names = list(MODES)
        for r in range(a.rounds):
            for name in names[r % 3:] + names[:r % 3]:  # each round starts with another mode
                wall, long_cpu = step_ms(where, data, a.nproc, a.iters, MODES[name])
                _, short_cpu = step_ms(where, data, a.nproc, SHORT, MODES[name])
                ms[name].append(wall)
                cpu[name].append(1e3 * (long_cpu - short_cpu) / (a.iters - SHORT))
    base = statistics.median(ms["disabled"])
    print(f"{a.nproc} ranks (gloo), 2-layer GPT hidden 32, 8 sequences of 16 tokens a step; medians of {a.rounds} "
          "rounds\n")
    print("| --rerun-mode | ms per step | ratio to disabled | ratio within each round |\n|---|---|---|---|")
    for name in MODES:
        m = statistics.median(ms[name])
        paired = sorted(x / d for x, d in zip(ms[name], ms["disabled"]))
        print(f"| {name} | {m:.1f} ({min(ms[name]):.1f}-{max(ms[name]):.1f}) | {m / base:.2f} | "
              f"{statistics.median(paired):.2f} ({paired[0]:.2f}-{paired[-1]:.2f}) |")
    print("\nCPU time per step, all ranks (a launch of --iters minus one of 5 iterations: start-up cancels; less "
          "sensitive to other jobs than the wall clock)\n")
    print("| --rerun-mode | CPU ms per step | ratio to disabled |\n|---|---|---|")
    base_cpu = statistics.median(cpu["disabled"])
    for name in MODES:
        m = statistics.median(cpu[name])
        print(f"| {name} | {m:.1f} ({min(cpu[name]):.1f}-{max(cpu[name]):.1f}) | {m / base_cpu:.2f} |")


if __name__ == "__main__":
    main()
