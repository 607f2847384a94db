"""The fused fp32 CPU kernels (csrc/cpu_ops) against their PyTorch fallbacks, one thread.

    .venv/bin/python bench/bench_cpu_kernels.py [--reps 30] [--threads 1]

Shapes are one micro-batch of the Megatron-DeepSpeed throughput model (bench_vs_megatron_deepspeed.py:
micro-batch 4, seq 256, hidden 256, 8 heads, ffn 1024, vocabulary 2048). Each row times forward +
backward of one op both ways in alternating rounds, so machine noise hits both alike, and prints the
median ms and the ratio fallback / kernel (above 1: the kernel is faster). Attention compares the
query-blocked path (the `fused` backend, and `auto` at s <= 256) with torch's flash kernel, which is
what `auto` ran before.
"""
import argparse
import datetime
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_zero import ops  # noqa: E402
from megatron_zero.model.attention_core import attention_core  # noqa: E402
from megatron_zero.ops.registry import CPU_OPS_EXT, load  # noqa: E402
from megatron_zero.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy  # noqa: E402

B, S, H, HEADS, FFN, VOCAB = 4, 256, 256, 8, 1024, 2048


def fwd_bwd(fn, *inputs):
    xs = [x.detach().requires_grad_() for x in inputs]

    def run():
        out = fn(*xs)
        out.backward(torch.ones_like(out))
    return run


def with_fusion(flag, on, run):
    def wrapped():
        old = ops.set_fusion_flags(**{flag: on})
        try:
            run()
        finally:
            ops.set_fusion_flags(**{flag: getattr(old, flag)})
    return wrapped


def cases():
    y, bias = torch.randn(S, B, FFN), torch.randn(FFN)
    x, w = torch.randn(S, B, H), torch.randn(H)
    logits, target = torch.randn(S, B, VOCAB), torch.randint(0, VOCAB, (S, B))
    out = {
        "bias-GeLU (tanh) [256, 4, 1024]": (
            with_fusion("bias_gelu_fusion", False, fwd_bwd(lambda a, b: ops.bias_gelu(b, a), y, bias)),
            with_fusion("bias_gelu_fusion", True, fwd_bwd(lambda a, b: ops.bias_gelu(b, a), y, bias))),
        "RMSNorm [256, 4, 256]": (
            fwd_bwd(lambda a, b: ops.rms_norm(a, b, 1e-5, fused=False), x, w),
            fwd_bwd(lambda a, b: ops.rms_norm(a, b, 1e-5, fused=True), x, w)),
        "cross-entropy [256, 4, 2048]": (
            fwd_bwd(lambda a: vocab_parallel_cross_entropy(a, target), logits),
            None),
    }
    for s in (256, 512):
        q, k, v = (torch.randn(B, HEADS, s, H // HEADS) for _ in range(3))
        out[f"causal attention [4, 8, {s}, 32]"] = (
            fwd_bwd(lambda a, b, c: attention_core(a, b, c, "flash", 0.0, True), q, k, v),
            fwd_bwd(lambda a, b, c: attention_core(a, b, c, "fused", 0.0, True), q, k, v))
    return out


def cross_entropy_fallback(run):
    """The cross-entropy with the exponentials' kernel hidden (its PyTorch fallback)."""
    import megatron_zero.tensor_parallel.cross_entropy as ce
    from megatron_zero.ops.exp_rows import exp_shifted_rows

    def wrapped():
        ce.exp_shifted_rows = lambda x, shift: exp_shifted_rows(x, shift, fused=False)
        try:
            run()
        finally:
            ce.exp_shifted_rows = exp_shifted_rows
    return wrapped


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    if load(CPU_OPS_EXT) is None:
        sys.exit(f"bench_cpu_kernels: {CPU_OPS_EXT} is not built (pip install --no-build-isolation -e .)")
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} thread(s), {datetime.date.today()}, "
          f"load average {os.getloadavg()[0]:.1f}")
    print("| op, fp32, forward + backward | PyTorch ms | kernel ms | PyTorch / kernel |")
    print("|---|---|---|---|")
    for name, (base, kernel) in cases().items():
        if kernel is None:  # cross-entropy: the same function with and without its exponentials' kernel
            base, kernel = cross_entropy_fallback(base), base
        times = {"base": [], "kernel": []}
        for _ in range(3):
            base(), kernel()
        for _ in range(args.reps):
            for key, run in (("base", base), ("kernel", kernel)):
                t0 = time.perf_counter()
                run()
                times[key].append((time.perf_counter() - t0) * 1e3)
        b, k = statistics.median(times["base"]), statistics.median(times["kernel"])
        print(f"| {name} | {b:.2f} | {k:.2f} | {b / k:.2f} |", flush=True)


if __name__ == "__main__":
    main()
