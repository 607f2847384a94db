"""Training step time of this tree against a baseline commit, pretrain_gpt.py as a user runs it.

    .venv/bin/python bench/bench_step_host_reads.py [--baseline d5c60dd] [--rounds 3] [--iters 40]

What it answers: what removing the per-step host reads and collectives costs or saves on the CPU
(the loss read every step, the exit flags' world all-reduce every step, one fp64 norm kernel per
parameter fragment). On a GPU each host read stalls the queue; on the CPU, where every op is already
synchronous, what is left to see is the collectives and kernel launches saved, so expect a small gain.

The baseline is `git archive <commit>` of this repository unpacked into a temporary directory, with this
tree's compiled kernels (megatron_zero/*.so) copied in, so both sides use the same kernels. Each
configuration is a 2-rank torchrun launch (gloo, OMP_NUM_THREADS=1) of a byte-level GPT on random
byte documents, --train-iters ITERS at --log-interval ITERS/4; a launch's time per iteration is the
median of its log lines after the first (each line averages its interval). Launches alternate between
the two trees (order reversed every round) so both share the machine's noise; the table shows the
median over rounds and ours / baseline (below 1: faster).
"""
import argparse
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from megatron_zero.testing.launch import byte_data, flags_argv  # noqa: E402
from megatron_zero.testing.multirank import free_port  # noqa: E402

CONFIGS = {  # name: flags (h: hidden size; 2 layers, seq 64 at h64; 4 layers, seq 256 at h256)
    "dp2-zero1-h64": {"hidden-size": 64, "num-layers": 2, "num-attention-heads": 4, "seq-length": 64,
                               "micro-batch-size": 2, "global-batch-size": 8, "zero-stage": 1},
    "pp2-h64-exit-handler": {"hidden-size": 64, "num-layers": 2, "num-attention-heads": 4,
                                      "seq-length": 64, "micro-batch-size": 2, "global-batch-size": 8,
                                      "pipeline-model-parallel-size": 2, "exit-signal-handler": True},
    "dp2-zero2-h256": {"hidden-size": 256, "num-layers": 4, "num-attention-heads": 8,
                                 "seq-length": 256, "micro-batch-size": 4, "global-batch-size": 16,
                                 "zero-stage": 2},
}


def baseline_tree(commit: str, where: str) -> str:
    tree = os.path.join(where, f"baseline_{commit}")
    os.makedirs(tree)
    archive = subprocess.run(["git", "-C", ROOT, "archive", commit], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", tree], input=archive, check=True)
    for name in os.listdir(os.path.join(ROOT, "megatron_zero")):
        if name.endswith(".so"):
            shutil.copy(os.path.join(ROOT, "megatron_zero", name), os.path.join(tree, "megatron_zero", name))
    return tree


def run(tree: str, flags: dict, data: str, cache: str, iters: int) -> float:
    """Median ms per iteration over the log lines after the first, of one 2-rank launch from `tree`."""
    argv = flags_argv({**flags, "tokenizer-type": "ByteTokenizer", "data-path": data, "split": "100,0,0",
                       "lr": 1e-4, "train-iters": iters, "log-interval": iters // 4, "eval-iters": 0,
                       "data-cache-path": cache})
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
           str(free_port()), os.path.join(tree, "pretrain_gpt.py")] + argv
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": tree}
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tree, timeout=1200)
    times = [float(x) for x in re.findall(r"elapsed time per iteration \(ms\): ([0-9.]+)", out.stdout)]
    if out.returncode != 0 or len(times) < 2:
        raise SystemExit(f"{tree}: exit {out.returncode}\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}")
    return statistics.median(times[1:])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", default="d5c60dd", help="commit to compare with")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--iters", type=int, default=40)
    parser.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated names from CONFIGS")
    args = parser.parse_args()
    import torch
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
          f"load {os.getloadavg()[0]:.1f}; baseline {args.baseline}")
    with tempfile.TemporaryDirectory() as tmp:
        base = baseline_tree(args.baseline, tmp)
        data = byte_data(os.path.join(tmp, "bytes"), docs=4000)
        sides = {"baseline": base, "ours": ROOT}
        rows = []
        for name in args.configs.split(","):
            times = {side: [] for side in sides}
            for r in range(args.rounds):
                order = list(sides) if r % 2 == 0 else list(reversed(sides))
                for side in order:
                    times[side].append(run(sides[side], CONFIGS[name], data, os.path.join(tmp, f"cache_{side}"),
                                           args.iters))
            b, o = statistics.median(times["baseline"]), statistics.median(times["ours"])
            rows.append((name, b, o, o / b, times))
            print(f"  {name}: baseline {times['baseline']} ours {times['ours']}", flush=True)
    print("\n| configuration | baseline ms/iter | ours ms/iter | ours / baseline |\n|---|---|---|---|")
    for name, b, o, ratio, _ in rows:
        print(f"| {name} | {b:.1f} | {o:.1f} | {ratio:.3f} |")
    print(f"load after: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
