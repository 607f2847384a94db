"""What result validation costs a step: --rerun-mode disabled vs validate_results (with the spike and large-gradient
checks) vs report_stats (every step run twice), pretrain_gpt.py as a user runs it.

    .venv/bin/python bench/bench_rerun.py [--rounds 3] [--iters 40] [--nproc 2]

Each round launches the three modes in turn, starting with another each round (so a busy machine slows them
alike): torchrun with
--nproc ranks (gloo, OMP_NUM_THREADS=1), the tiny 2-layer GPT of the command-line tests on byte-level text,
no fault injected. The time per step is the median of the log's `elapsed time per iteration` over the
iterations after the first five; the table gives each mode's median over the rounds, its ratio to disabled
measured in the same run, and the median (range) of its ratio to the disabled launch of the same round.
"""
import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_zero.testing.cli import cli_flags, text_data  # noqa: E402
from megatron_zero.testing.launch import PRETRAIN  # noqa: E402
from megatron_zero.testing.multirank import free_port  # noqa: E402

MODES = {
    "disabled": {},
    "validate_results": {"rerun-mode": "validate_results", "check-for-spiky-loss": True,
                         "check-for-large-grads": True},
    "report_stats": {"rerun-mode": "report_stats"},
}


def step_ms(where: str, data: str, nproc: int, iters: int, mode: dict) -> float:
    argv = cli_flags(data, os.path.join(where, "cache"), "gpt2", {"train-iters": iters}, mode)
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
                          "--master_port", str(free_port()), PRETRAIN] + argv, capture_output=True, text=True,
                         timeout=900, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    times = [float(x) for x in re.findall(r"elapsed time per iteration \(ms\): ([0-9.]+)", run.stdout)]
    return statistics.median(times[5:])


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--iters", type=int, default=40)
    p.add_argument("--nproc", type=int, default=2)
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as where:
        data = text_data(os.path.join(where, "text"))
        ms = {name: [] for name in MODES}
        names = list(MODES)
        for r in range(a.rounds):
            for name in names[r % 3:] + names[:r % 3]:  # each round starts with another mode
                ms[name].append(step_ms(where, data, a.nproc, a.iters, MODES[name]))
    base = statistics.median(ms["disabled"])
    print(f"{a.nproc} ranks (gloo), 2-layer GPT hidden 32, 8 sequences of 16 tokens a step; medians of {a.rounds} "
          "rounds\n")
    print("| --rerun-mode | ms per step | ratio to disabled | ratio within each round |\n|---|---|---|---|")
    for name in MODES:
        m = statistics.median(ms[name])
        paired = sorted(x / d for x, d in zip(ms[name], ms["disabled"]))
        print(f"| {name} | {m:.1f} ({min(ms[name]):.1f}-{max(ms[name]):.1f}) | {m / base:.2f} | "
              f"{statistics.median(paired):.2f} ({paired[0]:.2f}-{paired[-1]:.2f}) |")


if __name__ == "__main__":
    main()
