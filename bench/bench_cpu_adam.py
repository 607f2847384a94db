"""Optimizer step time on the CPU: megatron_zero's C++ AdamW vs torch and DeepSpeed.

    .venv/bin/python bench/bench_cpu_adam.py [--sizes 10e6 100e6] [--reps 21]

One flat fp32 parameter of each size (as a ZeRO-Offload partition is); every
optimizer steps the same parameter and gradient with its own moments, in
rounds (shuffled order) so machine noise hits all alike. Prints median ms per step and the
ratio to torch.optim.AdamW(fused=True), measured in the same run, and the
fastest step seen (the least disturbed by other work on the machine).
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


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=float, nargs="+", default=[10e6, 100e6])
    ap.add_argument("--reps", type=int, default=21)
    args = ap.parse_args()
    assert available_kernels()["cpu_adam"] is True, "build the C++ CPU Adam first (setup_env.sh)"
    print(f"machine: {cpu_model()}, {torch.get_num_threads()} threads, torch {torch.__version__}, "
          f"cpu_adam ISA {load('megatron_zero._C_cpu_adam').isa()}, "
          f"{datetime.date.today().isoformat()}, load average {os.getloadavg()[0]:.1f}")
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

if __name__ == "__main__":
    main()
