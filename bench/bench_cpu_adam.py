"""Optimizer step time on the CPU: megatron_zero's C++ AdamW vs torch and DeepSpeed.

    .venv/bin/python bench/bench_cpu_adam.py [--sizes 10e6 100e6] [--reps 21] [--threads 1 2 16]

One flat fp32 parameter of each size (as a ZeRO-Offload partition is); every
optimizer steps the same parameter and gradient with its own moments, in
rounds (shuffled order) so machine noise hits all alike. Prints median ms per step and the
ratio to torch.optim.AdamW(fused=True), measured in the same run, and the
fastest step seen (the least disturbed by other work on the machine).

Then the ZeRO-Offload step (adamw_step_ with the bf16 copy-out, as zero/offload.py calls it) at
1, 2 and all of this process's cores (--threads; --cpu-optimizer-threads in training), torch's own
intra-op count set to 1 as torchrun sets it: median ms and the speed-up over 1 thread, same run.
"""
import argparse
import contextlib
import datetime
import io
import os
import platform
import random
import statistics
import subprocess
import time

import torch

from megatron_zero.ops import CPUAdamW, adamw_step_, available_kernels
from megatron_zero.ops.registry import load

HP = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)


def cpu_model():
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        name = next(line.split(":", 1)[1].strip() for line in out.splitlines()
                    if line.startswith("Model name"))
    except (OSError, StopIteration):
        name = platform.processor() or "unknown CPU"
    return name


def deepspeed_adam(param):
    """DeepSpeedCPUAdam, or the reason it is unavailable (it JIT-builds on first use)."""
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            from deepspeed.ops.adam import DeepSpeedCPUAdam
            opt = DeepSpeedCPUAdam([param], adamw_mode=True, **HP)
            opt.step()
        return opt
    except Exception as e:  # not installed, or its C++ op failed to build
        return f"unavailable: {type(e).__name__}: {str(e)[:80]}"


def candidates(param):
    """name -> zero-argument step function (or a string saying why it is missing)."""
    out = {"torch AdamW fused=True": torch.optim.AdamW([param], fused=True, **HP).step,
           "torch AdamW foreach=True": torch.optim.AdamW([param], foreach=True, **HP).step}
    out["megatron_zero CPUAdamW"] = CPUAdamW([param], **HP).step
    m, v = torch.zeros_like(param), torch.zeros_like(param)
    low = torch.empty_like(param, dtype=torch.bfloat16)
    step = [0]

    def with_bf16_copy():
        step[0] += 1
        adamw_step_(param.data, param.grad, m, v, step=step[0], lr=HP["lr"], beta1=0.9,
                    beta2=0.999, eps=HP["eps"], weight_decay=HP["weight_decay"], low_out=low)

    out["megatron_zero + bf16 copy-out"] = with_bf16_copy
    torch_opt = torch.optim.AdamW([param], fused=True, **HP)

    def torch_then_cast():
        torch_opt.step()
        low.copy_(param.data)

    out["torch fused + bf16 cast"] = torch_then_cast
    ds = deepspeed_adam(param)
    out["DeepSpeedCPUAdam"] = ds if isinstance(ds, str) else ds.step
    return out


def measure(numel, reps):
    param = torch.nn.Parameter(torch.randn(int(numel)))
    param.grad = torch.randn(int(numel)) * 1e-2
    fns = candidates(param)
    times = {name: [] for name, fn in fns.items() if callable(fn)}
    for name in times:  # warm-up: allocate state, first-touch pages
        fns[name]()
        fns[name]()
    order, rng = list(times), random.Random(0)
    for _ in range(reps):
        rng.shuffle(order)  # no optimizer always runs right after the slow foreach one
        for name in order:
            t0 = time.perf_counter()
            fns[name]()
            times[name].append(time.perf_counter() - t0)
    return {name: (statistics.median(times[name]) * 1e3, min(times[name]) * 1e3)
            if name in times else fns[name] for name in fns}


def measure_threads(numel, reps, counts):
    """{threads: (median ms, min ms)} of the offloaded step (bf16 copy-out), counts in shuffled rounds."""
    p, g = torch.randn(int(numel)), torch.randn(int(numel)) * 1e-2
    m, v, low = torch.zeros_like(p), torch.zeros_like(p), torch.empty_like(p, dtype=torch.bfloat16)
    step = [0]

    def run(threads):
        step[0] += 1
        adamw_step_(p, g, m, v, step=step[0], lr=HP["lr"], beta1=0.9, beta2=0.999, eps=HP["eps"],
                    weight_decay=HP["weight_decay"], low_out=low, threads=threads)
    times = {n: [] for n in counts}
    for n in counts:
        run(n)
    order, rng = list(counts), random.Random(1)
    for _ in range(reps):
        rng.shuffle(order)
        for n in order:
            t0 = time.perf_counter()
            run(n)
            times[n].append(time.perf_counter() - t0)
    return {n: (statistics.median(t) * 1e3, min(t) * 1e3) for n, t in times.items()}


def thread_table(sizes, reps, counts):
    torch_threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as under torchrun: the kernel's count is the only one that matters
    try:
        results = {int(n): measure_threads(n, reps, counts) for n in sizes}
    finally:
        torch.set_num_threads(torch_threads)
    print(f"\nZeRO-Offload step (adamw_step_ + bf16 copy-out), torch intra-op threads 1; "
          f"{len(os.sched_getaffinity(0))} cores in this process's affinity mask")
    print("| threads | " + " | ".join(f"{n / 1e6:g}M: median ms | min ms | speed-up" for n in results) + " |")
    print("|" + "---|" * (1 + 3 * len(results)))
    for t in counts:
        cells = []
        for res in results.values():
            cells += [f"{res[t][0]:.1f}", f"{res[t][1]:.1f}", f"{res[counts[0]][0] / res[t][0]:.2f}"]
        print(f"| {t} | " + " | ".join(cells) + " |")
    print(f"({reps} steps each, in shuffled rounds; speed-up = median at {counts[0]} thread(s) / median)")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=float, nargs="+", default=[10e6, 100e6])
    ap.add_argument("--reps", type=int, default=21)
    ap.add_argument("--threads", type=int, nargs="+", default=None,
                    help="thread counts of the offloaded step (default: 1, 2 and all cores)")
    ap.add_argument("--threads-only", action="store_true", help="only the thread-count table")
    args = ap.parse_args()
    cores = len(os.sched_getaffinity(0))
    counts = args.threads or sorted({1, min(2, cores), cores})
    if min(counts) < 1:
        ap.error(f"--threads {counts}: every count must be at least 1")
    assert available_kernels()["cpu_adam"] is True, "build the C++ CPU Adam first (setup_env.sh)"
    print(f"machine: {cpu_model()}, {torch.get_num_threads()} threads, torch {torch.__version__}, "
          f"cpu_adam ISA {load('megatron_zero._C_cpu_adam').isa()}, "
          f"{datetime.date.today().isoformat()}, load average {os.getloadavg()[0]:.1f}")
    if args.threads_only:
        return thread_table(args.sizes, args.reps, counts)
    results = {int(n): measure(n, args.reps) for n in args.sizes}
    names = list(next(iter(results.values())))
    print("| optimizer step | " + " | ".join(
        f"{n / 1e6:g}M: median ms | min ms | ratio" for n in results) + " |")
    print("|" + "---|" * (1 + 3 * len(results)))
    for name in names:
        cells = []
        for res in results.values():
            got, base = res[name], res["torch AdamW fused=True"][0]
            cells += ([f"{got[0]:.1f}", f"{got[1]:.1f}", f"{got[0] / base:.2f}"]
                      if isinstance(got, tuple) else [got, "-", "-"])
        print(f"| {name} | " + " | ".join(cells) + " |")
    print(f"({args.reps} steps each, in shuffled rounds; ratio = median / median of torch AdamW "
          "fused=True; lower is faster)")
    thread_table(args.sizes, args.reps, counts)

if __name__ == "__main__":
    main()
