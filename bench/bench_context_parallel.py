"""Context parallelism: the longest sequence a rank's memory budget trains at CP 1, 2 and 4, tokens/s against
CP 1 at one sequence length, and the overlap the p2p ring achieves.

    .venv/bin/python bench/bench_context_parallel.py [--budget-mib 48] [--cps 2 4] [--reps 2]

The model: a small Llama (RMSNorm, RoPE, SwiGLU, grouped-query attention, untied head; --layers, --hidden,
--heads, --groups, --vocab), full recomputation (one layer per checkpoint), fp32, micro-batch 1, dropout 0.
One training step = forward of the whole model to the loss and backward. Each CP runs in fresh gloo ranks
(one thread each), glibc serving allocations above 64 KiB by mmap so that freed memory leaves the process:

(a) memory: a step's peak = the process's high-water RSS during the step minus its RSS before it (the
    parameters, their gradients and the process itself are there before; a warm-up step first), the
    largest over the CP ranks. The longest sequence whose peak stays within --budget-mib: doubling from
    --start * CP until one is over, then bisecting to a multiple of 64 tokens (within 1/16 of the answer).
    With --cp-comm-type p2p (--search-comm-type); the activations a rank holds are s / CP tokens' worth,
    so the answer should grow about linearly with CP.
(b) tokens/s: the whole sequence / the step's wall time (the slowest rank), median of --reps steps, at the
    longest sequence CP 1 trained in (a), every --cp-comm-type; the baseline is CP 1 in the same run
    (SDPA's attention).
(c) overlap of the p2p ring (context_parallel/ring_attention.py, instrumented here, not changed): during
    the (b) steps every posted exchange is recorded and the time spent waiting on exchanges is summed
    (exposed); afterwards each recorded exchange is replayed alone, posted and waited on at once (its
    whole communication time). overlap = 1 - exposed / replayed, the share of the ring's communication
    hidden behind its compute, per rank, the lowest over the ranks. A wait also absorbs a slower peer's
    compute, so this errs low.
On a machine with fewer cores than CP ranks the ranks share cores: memory carries over, tokens/s and the
overlap measure contention as much as the method (gloo's transfers run on threads competing with compute).
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

from megatron_zero.context_parallel import ring_attention, slice_sequence_for_cp  # noqa: E402
from megatron_zero.model.config import GPTConfig  # noqa: E402
from megatron_zero.model.gpt import GPTModel  # noqa: E402
from megatron_zero.tensor_parallel import model_parallel_seed  # noqa: E402
from megatron_zero.testing import run_ranks  # noqa: E402
from megatron_zero.testing.tiny_gpt import LLAMA_ARCHITECTURE  # noqa: E402
from megatron_zero.topology import build_parallel_state  # noqa: E402

M_MMAP_THRESHOLD = -3
QUANTUM = 64  # sequence lengths searched: multiples of this (and of 2 x CP)
COMM_TYPES = ("p2p", "all_gather", "a2a")


def _status_bytes(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {key}")


class RingProbe:
    """Records the ring's exchanges and the time spent waiting on them, by wrapping the module's two helpers."""

    def __init__(self):
        self.exchanges, self.exposed, self.active = [], 0.0, False
        self._post, self._wait = ring_attention._ring_exchange, ring_attention._wait

    def __enter__(self):
        def post(send, recv, ranks, cp_rank, group, tag):
            if self.active:
                self.exchanges.append((send.shape, send.dtype, ranks, cp_rank, group, tag))
            return self._post(send, recv, ranks, cp_rank, group, tag)

        def wait(requests):
            start = time.perf_counter()
            self._wait(requests)
            if self.active:
                self.exposed += time.perf_counter() - start

        ring_attention._ring_exchange, ring_attention._wait = post, wait
        return self

    def __exit__(self, *exc):
        ring_attention._ring_exchange, ring_attention._wait = self._post, self._wait

    def replayed(self) -> float:
        """Every recorded exchange again, alone: posted, then waited on at once (all ranks replay the same list)."""
        dist.barrier()
        total = 0.0
        for shape, dtype, ranks, cp_rank, group, tag in self.exchanges:
            send, recv = torch.randn(shape).to(dtype), torch.empty(shape, dtype=dtype)
            start = time.perf_counter()
            self._wait(self._post(send, recv, ranks, cp_rank, group, tag))
            total += time.perf_counter() - start
        return total


def build(a, seq, comm_type, cp_group):
    config = GPTConfig(vocab_size=a.vocab, hidden_size=a.hidden, num_layers=a.layers, num_attention_heads=a.heads,
                       num_query_groups=a.groups, ffn_hidden_size=a.ffn or None, seq_length=seq,
                       max_position_embeddings=seq, hidden_dropout=0.0, attention_dropout=0.0,
                       recompute_granularity="full", recompute_method="uniform", cp_comm_type=comm_type,
                       **LLAMA_ARCHITECTURE)
    return GPTModel(config, cp_group=cp_group)


def step(model, seq, cp, cp_rank, cp_group, seed):
    """One training step on one sequence of `seq` tokens -> (peak bytes above the step's start, seconds),
    each the largest over the CP ranks."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, model.config.vocab_size, (1, seq + 1), generator=g)
    inputs, labels = (slice_sequence_for_cp(t, cp, cp_rank) for t in (tokens[:, :-1], tokens[:, 1:]))
    gc.collect()
    before = _status_bytes("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the high-water mark
    if cp > 1:
        dist.barrier()
    start = time.perf_counter()
    model(inputs, labels=labels).backward()
    result = torch.tensor([time.perf_counter() - start, float(_status_bytes("VmHWM") - before)], dtype=torch.float64)
    if cp > 1:
        dist.all_reduce(result, op=dist.ReduceOp.MAX)
    return int(result[1]), float(result[0])


def longest(fits, start: int, quantum: int):
    """The longest multiple of `quantum` for which fits(s) holds: doubling from `start`, then bisecting
    (to within max(quantum, answer / 16)) -> (longest, its peak, the shortest over, probes)."""
    lo, lo_peak, hi, probes, s = 0, 0, None, 0, start
    while hi is None:
        ok, peak = fits(s)
        probes += 1
        if ok:
            lo, lo_peak, s = s, peak, 2 * s
        else:
            hi = s
        if lo == 0 and hi is not None and hi > quantum:  # the first is already over: halve
            s, hi = max(quantum, hi // 2 // quantum * quantum), None
    while lo and hi - lo > max(quantum, lo // 16):
        mid = (lo + hi) // 2 // quantum * quantum
        ok, peak = fits(mid)
        probes += 1
        if ok:
            lo, lo_peak = mid, peak
        else:
            hi = mid
    return lo, lo_peak, hi, probes


def measure(a, throughput_seq):
    """On every rank of one CP group: (a)'s search, then (b) and (c) at throughput_seq (None: the searched length)."""
    ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, 64 * 1024)
    cp = dist.get_world_size()
    state = build_parallel_state(cp=cp)
    model_parallel_seed(1, 0, 0, state.cp_rank)
    quantum = QUANTUM * cp
    model = build(a, quantum, a.search_comm_type if cp > 1 else "p2p", state.cp_group)
    step(model, quantum, cp, state.cp_rank, state.cp_group, 0)  # warm-up: gradients allocated, kernels loaded
    budget = a.budget_mib * 2**20

    def fits(seq):
        peak = step(model, seq, cp, state.cp_rank, state.cp_group, seq)[0]
        return peak <= budget, peak

    found = longest(fits, a.start * cp, quantum)
    seq = throughput_seq or found[0]
    rates = {}
    for comm_type in (COMM_TYPES if cp > 1 else ("-",)):
        model.config.cp_comm_type = comm_type if cp > 1 else "p2p"
        step(model, quantum, cp, state.cp_rank, state.cp_group, 1)
        with RingProbe() as probe:
            probe.active = comm_type == "p2p"
            times = [step(model, seq, cp, state.cp_rank, state.cp_group, 10 + r)[1] for r in range(a.reps)]
            probe.active = False
            overlap = None
            if comm_type == "p2p":
                replayed = probe.replayed()
                mine = torch.tensor([1.0 - probe.exposed / replayed, probe.exposed, replayed], dtype=torch.float64)
                lowest = mine.clone()
                dist.all_reduce(lowest, op=dist.ReduceOp.MIN)
                overlap = (float(lowest[0]), float(mine[1]), float(mine[2]), len(probe.exchanges) // a.reps)
        rates[comm_type] = (statistics.median(times), overlap)
    return found, seq, rates


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget-mib", type=float, default=48.0, help="per-rank peak memory of a step, above its start")
    ap.add_argument("--cps", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--start", type=int, default=512, help="the search starts at this times CP tokens")
    ap.add_argument("--search-comm-type", choices=COMM_TYPES, default="p2p")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--groups", type=int, default=4, help="KV groups (grouped-query attention)")
    ap.add_argument("--ffn", type=int, default=0, help="SwiGLU width (0: Llama's rule from the hidden size)")
    ap.add_argument("--vocab", type=int, default=512)
    a = ap.parse_args()
    print(f"# {platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}; "
          f"Llama {a.layers} layers, hidden {a.hidden}, {a.heads} heads / {a.groups} KV groups, vocab {a.vocab}, "
          f"full recompute, micro-batch 1, fp32, 1 thread per rank; budget {a.budget_mib:g} MiB per rank")
    t0 = time.time()
    base = run_ranks(measure, 1, a, None, timeout=3600)[0]
    (base_len, base_peak, base_over, base_probes), seq, base_rates = base
    base_step = base_rates["-"][0]
    print("\n(a) longest sequence within the budget (p2p at CP > 1)\n")
    print("| CP | longest | / CP1 | peak MiB there | first over | probes |")
    print("|---|---|---|---|---|---|")
    print(f"| 1 | {base_len} | 1.00 | {base_peak / 2**20:.1f} | {base_over} | {base_probes} |", flush=True)
    rows = []
    for cp in a.cps:
        (n, peak, over, probes), _, rates = run_ranks(measure, cp, a, seq, timeout=3600)[0]
        print(f"| {cp} | {n} | {n / base_len:.2f} | {peak / 2**20:.1f} | {over} | {probes} |", flush=True)
        rows.append((cp, rates))
    print(f"\n(b) tokens/s at {seq} tokens (CP1's longest), (c) the p2p ring's overlap\n")
    print("| CP | comm | step s | tokens/s | / CP1 | ring overlap (lowest rank) | exposed s / replayed s (rank 0) |")
    print("|---|---|---|---|---|---|---|")
    print(f"| 1 | - (SDPA) | {base_step:.2f} | {seq / base_step:.0f} | 1.00 | | |")
    for cp, rates in rows:
        for comm_type, (t, overlap) in rates.items():
            ring = "" if overlap is None else f"{overlap[0]:.2f} | {overlap[1]:.3f} / {overlap[2]:.3f}"
            print(f"| {cp} | {comm_type} | {t:.2f} | {seq / t:.0f} | {base_step / t:.2f} | {ring or ' |'} |")
    print(f"\n# {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
