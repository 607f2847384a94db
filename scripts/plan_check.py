"""The planner's prediction against a measured run, one JSON line per case appended to a file, so the time
model's constants (megatron_zero/planning/time_model.py) can be re-fit as GPU runs arrive:

    python scripts/plan_check.py --out plan_check.jsonl [--cases gpt-1.3b,llama3-8b-16l] [--iters 6]

Each case: tools/plan.py's --json for the flags (one GPU), then pretrain_gpt.py with the same flags on mock
data in a process of its own: peak memory from torch.cuda.max_memory_allocated, the step time the median of
the logged iterations after the first two. The line holds both and their ratios. On a machine without CUDA
the measured peak is null (the step time is the CPU's). scripts/gpu_check.sh runs it.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMMON = ["--lr", "1e-4", "--lr-decay-style", "constant", "--hidden-dropout", "0", "--attention-dropout", "0",
          "--mock-data", "--tokenizer-type", "NullTokenizer", "--eval-iters", "0", "--log-interval", "1",
          "--zero-stage", "1", "--seed", "1234"]
LLAMA = ["--normalization", "RMSNorm", "--position-embedding-type", "rope", "--swiglu", "--disable-bias-linear",
         "--untie-embeddings-and-output-weights", "--group-query-attention", "--num-query-groups", "8"]
# our H200 runs (BENCHMARKS.md, the GPU section): the 1.3B fitted the time model, the Llama shape checks it
CASES = {
    "gpt-1.3b": ["--num-layers", "24", "--hidden-size", "2048", "--num-attention-heads", "16", "--seq-length", "2048",
                 "--max-position-embeddings", "2048", "--micro-batch-size", "4", "--global-batch-size", "32",
                 "--vocab-size", "255", "--bf16"],
    "llama3-8b-16l": ["--num-layers", "16", "--hidden-size", "4096", "--num-attention-heads", "32", "--ffn-hidden-size",
                      "14336", "--seq-length", "4096", "--max-position-embeddings", "4096", "--micro-batch-size", "1",
                      "--global-batch-size", "8", "--vocab-size", "255", "--bf16", *LLAMA],
    "tiny": ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
             "--max-position-embeddings", "64", "--micro-batch-size", "2", "--global-batch-size", "4",
             "--vocab-size", "255"],
}
STEP_MS = re.compile(r"elapsed time per iteration \(ms\): ([\d.]+)")
PEAK = re.compile(r"plan_check: peak allocated bytes (-?\d+)")
WRAPPER = ("import runpy, sys, torch\nsys.argv = sys.argv[1:]\ntry:\n    runpy.run_path(sys.argv[0], "
           "run_name='__main__')\nfinally:\n    print('plan_check: peak allocated bytes', "
           "torch.cuda.max_memory_allocated() if torch.cuda.is_available() else -1, flush=True)\n")


def check(name: str, iters: int, gpu_tflops: float) -> dict:
    flags = [*CASES[name], *COMMON, "--train-iters", str(iters), "--eval-interval", str(iters + 1)]
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    plan = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "plan.py"), *flags, "--gpus", "1",
                           "--gpu-tflops", str(gpu_tflops), "--json"], capture_output=True, text=True, env=env)
    if plan.returncode:
        return dict(case=name, error="plan: " + (plan.stderr.strip().splitlines() or ["?"])[-1])
    predicted = json.loads(plan.stdout)
    run = subprocess.run([sys.executable, "-c", WRAPPER, os.path.join(ROOT, "pretrain_gpt.py"), *flags],
                         capture_output=True, text=True, env=env)
    out = run.stdout + run.stderr
    steps = [float(ms) / 1e3 for ms in STEP_MS.findall(out)][2:]
    peak = [int(b) for b in PEAK.findall(out)]
    measured_peak = peak[-1] if peak and peak[-1] >= 0 else None
    measured_step = statistics.median(steps) if steps else None
    line = dict(case=name, time=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), flags=flags,
                predicted_peak=predicted["peak"], measured_peak=measured_peak,
                predicted_step_seconds=predicted["step_seconds"], measured_step_seconds=measured_step,
                predicted_mfu=predicted["mfu"], constants=predicted["constants"], returncode=run.returncode)
    if measured_peak:
        line["peak_ratio"] = predicted["peak"] / measured_peak
    if measured_step:
        line["step_ratio"] = predicted["step_seconds"] / measured_step
    return line


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="JSON lines file the results are appended to")
    p.add_argument("--cases", default="gpt-1.3b,llama3-8b-16l", help=f"comma-separated, of {sorted(CASES)}")
    p.add_argument("--iters", type=int, default=6)
    p.add_argument("--gpu-tflops", type=float, default=989.0, help="the GPU's bf16 dense peak")
    a = p.parse_args(argv)
    unknown = sorted(set(a.cases.split(",")) - set(CASES))
    if unknown:
        p.error(f"unknown case(s) {unknown}; the cases are {sorted(CASES)}")
    failed = 0
    for name in a.cases.split(","):
        line = check(name, a.iters, a.gpu_tflops)
        failed += bool(line.get("error") or line.get("returncode"))
        with open(a.out, "a") as f:
            f.write(json.dumps(line) + "\n")
        print(json.dumps({k: v for k, v in line.items() if k not in ("flags", "constants")}), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
