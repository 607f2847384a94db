"""Context parallelism: activation memory and step time of one rank at CP 1, 2 and 4, each --cp-comm-type.

    .venv/bin/python bench/bench_context_parallel.py [--seqs 4096 8192] [--layers 2] [--hidden 256] [--heads 8]

What is measured, and how (as bench/bench_activation_memory.py): one pipeline stage holding only
transformer layers runs forward and backward on its part of one micro-batch [1, s / CP, h] (dropout 0),
each configuration in fresh gloo ranks (run_ranks), glibc serving allocations above 64 KiB by mmap, the
high-water mark reset after a warm-up; rank 0's numbers:
    held = resident bytes after forward - before; peak = high-water mark over forward + backward - before;
    step = median wall time of forward + backward over --reps steps (every rank's slowest).
The baseline is CP 1 in the same run (SDPA's attention, `auto`); tokens/s is s / step (the same whole
sequence at every CP). On a machine with fewer cores than CP x ranks the ranks share cores, so step
times there measure contention as much as the method: the memory columns carry over, the times need one
core (or GPU) per rank.
"""
import argparse
import ctypes
import gc
import os
import platform
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from megatron_zero.context_parallel import slice_sequence_for_cp  # noqa: E402
from megatron_zero.model.config import GPTConfig  # noqa: E402
from megatron_zero.model.gpt import GPTModel  # noqa: E402
from megatron_zero.model.layer_indices import block_layer_index  # noqa: E402
from megatron_zero.tensor_parallel import model_parallel_seed  # noqa: E402
from megatron_zero.testing import run_ranks  # noqa: E402
from megatron_zero.topology import build_parallel_state  # noqa: E402

M_MMAP_THRESHOLD = -3


def _status_bytes(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {key}")


def measure(seq, layers, hidden, heads, comm_type, reps):
    ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, 64 * 1024)
    cp = dist.get_world_size()
    state = build_parallel_state(cp=cp)
    model_parallel_seed(1, 0, 0, state.cp_rank)
    config = GPTConfig(vocab_size=1024, hidden_size=hidden, num_layers=layers, num_attention_heads=heads,
                       seq_length=seq, max_position_embeddings=seq, hidden_dropout=0.0, attention_dropout=0.0,
                       cp_comm_type=comm_type)
    model = GPTModel(config, layer_indices=range(block_layer_index(0), block_layer_index(layers)),
                     cp_group=state.cp_group)
    times, held, peak = [], 0, 0
    for step, s in enumerate([64 * cp] + [seq] * reps):  # a warm-up, then the measured steps
        whole = torch.randn(1, s, hidden, generator=torch.Generator().manual_seed(step))
        x = slice_sequence_for_cp(whole, cp, state.cp_rank).requires_grad_()
        grad = torch.ones_like(x)
        model.zero_grad(set_to_none=False)
        gc.collect()
        before = _status_bytes("VmRSS")
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        if cp > 1:
            dist.barrier()
        start = time.perf_counter()
        y = model(x)
        held = max(held, _status_bytes("VmRSS") - before) if step else 0
        y.backward(grad)
        elapsed = torch.tensor([time.perf_counter() - start])
        if cp > 1:
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        peak = max(peak, _status_bytes("VmHWM") - before) if step else 0
        if step:
            times.append(float(elapsed))
        del y
    return held, peak, statistics.median(times)


def mib(n):
    return f"{n / 2**20:8.1f}"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqs", type=int, nargs="+", default=[4096, 8192])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--cps", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args()
    print(f"# {platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}; "
          f"{a.layers} layers, hidden {a.hidden}, {a.heads} heads, micro-batch 1, fp32, 1 thread per rank")
    print("| seq | CP | comm | held MiB | peak MiB | peak / CP1 | step s | tokens/s | tokens/s / CP1 |")
    print("|---|---|---|---|---|---|---|---|---|")
    for seq in a.seqs:
        base = run_ranks(measure, 1, seq, a.layers, a.hidden, a.heads, "p2p", a.reps, timeout=3600)[0]
        print(f"| {seq} | 1 | - | {mib(base[0])} | {mib(base[1])} | 1.00 | {base[2]:.2f} | {seq / base[2]:.0f} | "
              "1.00 |", flush=True)
        for cp in a.cps:
            for comm_type in ("p2p", "all_gather", "a2a"):
                held, peak, step = run_ranks(measure, cp, seq, a.layers, a.hidden, a.heads, comm_type, a.reps,
                                             timeout=3600)[0]
                print(f"| {seq} | {cp} | {comm_type} | {mib(held)} | {mib(peak)} | {peak / base[1]:.2f} | "
                      f"{step:.2f} | {seq / step:.0f} | {base[2] / step:.2f} |", flush=True)


if __name__ == "__main__":
    main()
