"""Training step time of this tree against a baseline commit, pretrain_gpt.py as a user runs it.

    .venv/bin/python bench/bench_step_host_reads.py [--baseline e0c29b0] [--rounds 3] [--iters 40]

What it answers: what removing the per-step host reads and collectives costs or saves on the CPU
(the loss read every step, the exit flags' world all-reduce every step, one fp64 norm kernel per
parameter fragment). On a GPU each host read stalls the queue; on the CPU, where every op is already
synchronous, what is left to see is the collectives and kernel launches saved, so expect a small gain.

The baseline is `git archive <commit>` of this repository unpacked into a temporary directory, with this
tree's compiled kernels (megatron_zero/*.so) copied in, so both sides use the same kernels. Each
configuration is a 2-rank torchrun launch (gloo, OMP_NUM_THREADS=1) of this script as the worker, with
that tree first on the path: it builds the Trainer from pretrain_gpt.py's flags (a byte-level GPT on
random byte documents, --train-iters ITERS at --log-interval ITERS/4) and stamps the start of every
step, so an iteration is everything from one step's start to the next (step, log line, exit check).
Per iteration: wall time (the slower rank) and CPU time (both ranks' processes, gloo's threads
included: it moves much less than wall time when other jobs load the machine); a launch's value is
the median over its iterations after the first 3. Launches alternate between the two trees (order
reversed every round) so both share the machine's noise; the table shows the median over rounds and
ours / baseline (below 1: faster).
"""
import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if sys.argv[1:2] != ["--worker"]:  # a worker imports megatron_zero from the tree on its PYTHONPATH
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
    "tp2-h256": {"hidden-size": 256, "num-layers": 4, "num-attention-heads": 8, "seq-length": 256,
                 "micro-batch-size": 4, "global-batch-size": 16, "tensor-model-parallel-size": 2},
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


def run(tree: str, flags: dict, data: str, cache: str, iters: int):
    """(wall ms, CPU ms) per iteration, medians, of one 2-rank launch of the worker from `tree`."""
    argv = flags_argv({**flags, "tokenizer-type": "ByteTokenizer", "data-path": data, "split": "100,0,0",
                       "lr": 1e-4, "train-iters": iters, "log-interval": iters // 4, "eval-iters": 0,
                       "data-cache-path": cache})
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
           str(free_port()), os.path.abspath(__file__), "--worker"] + argv
    stamp_dir = tempfile.mkdtemp(dir=cache if os.path.isdir(cache) else None)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": tree, "BENCH_STAMPS_DIR": stamp_dir}
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tree, timeout=1800)
    # a file per rank: two ranks' lines on one stdout can interleave
    stamps = [json.load(open(os.path.join(stamp_dir, f))) for f in sorted(os.listdir(stamp_dir))]
    shutil.rmtree(stamp_dir, ignore_errors=True)
    if out.returncode != 0 or len(stamps) != 2:
        raise SystemExit(f"{tree}: exit {out.returncode}\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}")
    wall = [max(s["wall"][i + 1] - s["wall"][i] for s in stamps) for i in range(3, iters - 1)]
    cpu = [sum(s["cpu"][i + 1] - s["cpu"][i] for s in stamps) for i in range(3, iters - 1)]
    return statistics.median(wall) * 1e3, statistics.median(cpu) * 1e3


def worker(argv):
    """One rank: train as pretrain_gpt.py would, stamping (wall, process CPU) at each step's start."""
    import torch.distributed as dist

    from megatron_zero.arguments import parse_args
    from megatron_zero.training import Trainer
    try:  # this tree's layout: the trainer takes the typed configuration
        from megatron_zero.config import from_args
        from megatron_zero.distributed.initialize import init_distributed
        from megatron_zero.distributed.topology import build_parallel_state
    except ImportError:  # a baseline from before the regrouping: modules at the root, the trainer takes the namespace
        from megatron_zero.distributed import init_distributed
        from megatron_zero.topology import build_parallel_state

        def from_args(args):
            return args

    init_distributed("gloo")
    args = parse_args(argv, world_size=dist.get_world_size())
    trainer = Trainer(from_args(args), build_parallel_state(args.tensor_model_parallel_size,
                                                            args.pipeline_model_parallel_size))
    stamps = {"wall": [], "cpu": []}
    step = trainer.train_step

    def stamped(*a, **k):
        stamps["wall"].append(time.perf_counter())
        stamps["cpu"].append(time.process_time())
        return step(*a, **k)

    trainer.train_step = stamped
    trainer.train()
    stamps["wall"].append(time.perf_counter())
    stamps["cpu"].append(time.process_time())
    with open(os.path.join(os.environ["BENCH_STAMPS_DIR"], f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump(stamps, f)
    trainer = None
    dist.destroy_process_group()


def main():
    if sys.argv[1:2] == ["--worker"]:
        return worker(sys.argv[2:])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", default="e0c29b0", help="commit to compare with (default: the tree before one "
                        "host read per step and ZeRO 0-2's buckets, whose kernels are this tree's)")
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
            med = {side: [statistics.median(v[k] for v in times[side]) for k in (0, 1)] for side in sides}
            rows.append((name, med["baseline"], med["ours"]))
            print(f"  {name}: (wall ms, CPU ms) baseline {times['baseline']} ours {times['ours']}", flush=True)
    print("\n| configuration | wall ms/iter baseline | ours | ours / baseline | CPU ms/iter baseline | ours | "
          "ours / baseline |\n|---|---|---|---|---|---|---|")
    for name, (bw, bc), (ow, oc) in rows:
        print(f"| {name} | {bw:.1f} | {ow:.1f} | {ow / bw:.3f} | {bc:.1f} | {oc:.1f} | {oc / bc:.3f} |")
    print(f"load after: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
