"""Peak memory of context parallelism's ring attention (p2p) on the CPU: its blocks by torch's flash kernel
against block_attention's query pieces (the path p2p ran before), forward and backward, in the same run.

    .venv/bin/python bench/bench_cp_attention_memory.py [--seqs 4096 8192] [--cp 2] [--heads 8] [--head-dim 64]

What is measured, and how. CP gloo ranks (one thread each, forked by run_ranks) each hold their s / CP
tokens' q, k, v [1, heads, s / CP, head-dim] fp32 and run ring attention forward and backward (attention
dropout 0); rank 0's numbers are printed (the ranks' shapes are equal). As in bench_activation_memory.py,
glibc serves every allocation above 64 KiB by mmap, so the resident set follows the tensors; after a
warm-up at a short sequence the kernel's high-water mark is reset and
    peak = high-water RSS during forward + backward - RSS before (q, k, v and the output gradient exist)
The block path's transient scores are [1, heads, QUERY_ROWS, keys of a block] fp32 (several at once: the
scores, the probabilities, their masks); the flash kernel's are its tiles. `q k v` is the bytes of this
rank's q, k and v, for scale. Time is the wall time of the step on rank 0 (informative, contended).
"""
import argparse
import ctypes
import gc
import os
import platform
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from bench_activation_memory import M_MMAP_THRESHOLD, mib  # noqa: E402  (bench/ is sys.path[0])
from megatron_zero.context_parallel import context_parallel_attention  # noqa: E402
from megatron_zero.testing import run_ranks  # noqa: E402
from megatron_zero.testing.host_memory import reset_high_water_mark, status_bytes  # noqa: E402


def measure(seq, heads, head_dim, backend):
    ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, 64 * 1024)
    cp = dist.get_world_size()
    for s in (16 * cp, seq):  # warm-up, then the measured step
        q, k, v = (torch.randn(1, heads, s // cp, head_dim, requires_grad=True) for _ in range(3))
        dout = torch.randn(1, heads, s // cp, head_dim)
        gc.collect()
        before = status_bytes("VmRSS")
        reset_high_water_mark()
        start = time.perf_counter()
        context_parallel_attention(q, k, v, dist.group.WORLD, "p2p", backend=backend).backward(dout)
        elapsed = time.perf_counter() - start
        peak = status_bytes("VmHWM") - before
    return peak, elapsed, 3 * q.numel() * 4


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqs", type=int, nargs="+", default=[4096, 8192])
    ap.add_argument("--cp", type=int, default=2)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64)
    a = ap.parse_args()
    print(f"# {platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}; "
          f"p2p CP {a.cp}, {a.heads} heads, head dim {a.head_dim}, micro-batch 1, fp32, 1 thread per rank")
    print("| seq | blocks by | peak MiB | peak / block path | q k v MiB | step s |")
    print("|---|---|---|---|---|---|")
    for seq in a.seqs:
        base = None
        for backend, name in (("unfused", "query pieces (before)"), ("flash", "flash kernel")):
            peak, elapsed, qkv = run_ranks(measure, a.cp, seq, a.heads, a.head_dim, backend, timeout=1800)[0]
            base = base or peak
            print(f"| {seq} | {name} | {mib(peak)} | {peak / base:.2f} | {mib(qkv)} | {elapsed:.2f} |", flush=True)


if __name__ == "__main__":
    main()
