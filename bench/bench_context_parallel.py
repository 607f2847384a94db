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
    At CP > 1 for each of --search-comm-types (p2p and a2a); the activations a rank holds are s / CP
    tokens' worth, so the answer should grow about linearly with CP.
(b) tokens/s: the whole sequence / the step's wall time (the slowest rank), median of --reps steps, at the
    longest sequence CP 1 trained in (a), every --cp-comm-type; the baseline is CP 1 in the same run
    (SDPA's attention).
(c) overlap of the p2p ring (context_parallel/ring_attention.py, instrumented here, not changed): during
    the (b) steps each exchange's posting time on every rank and the start and end of this rank's wait on
    it are recorded; afterwards every recorded exchange is replayed alone, posted and waited on at once
    (total = the sum: the ring's whole communication time). Exposed = the part of each wait after this rank
    and both ring neighbours had posted that exchange (earlier, the wait is for a peer still computing),
    at most the exchange's replayed time. overlap = 1 - exposed / total, the share of the communication
    hidden behind compute; the lowest over the ranks.
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
from megatron_zero.distributed.topology import build_parallel_state  # noqa: E402

M_MMAP_THRESHOLD = -3
QUANTUM = 64  # sequence lengths searched: multiples of this (and of 2 x CP)
COMM_TYPES = ("p2p", "all_gather", "a2a")


def _status_bytes(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {key}")


class Posted(list):
    """The requests of one posted exchange, numbered in posting order."""
    index = 0


class RingProbe:
    """Records when each ring exchange is posted and when the waits on it start and end, by wrapping the
    module's two helpers; `overlap` then needs every rank's records and a replay of the exchanges."""

    def __init__(self):
        self.exchanges, self.posted, self.waits, self.active = [], [], {}, False
        self._post, self._wait = ring_attention._ring_exchange, ring_attention._wait

    def __enter__(self):
        def post(send, recv, ranks, cp_rank, group, tag):
            requests = Posted(self._post(send, recv, ranks, cp_rank, group, tag))
            if self.active:
                requests.index = len(self.exchanges)
                self.exchanges.append((send.shape, send.dtype, ranks, cp_rank, group, tag))
                self.posted.append(time.monotonic())  # CLOCK_MONOTONIC: one clock for every process of the host
            return requests

        def wait(requests):
            start = time.monotonic()
            self._wait(requests)
            if self.active:
                self.waits[requests.index] = (start, time.monotonic())

        ring_attention._ring_exchange, ring_attention._wait = post, wait
        return self

    def __exit__(self, *exc):
        ring_attention._ring_exchange, ring_attention._wait = self._post, self._wait

    def overlap(self, cp: int):
        """(hidden / total, exposed s, total s) of this rank. total: every recorded exchange replayed alone
        (posted, then waited on at once; all ranks replay the same list). Exposed: the part of a wait after
        this rank and both its ring neighbours had posted that exchange (before that, the wait is for a
        peer still computing, not for communication), at most the exchange's replayed time."""
        dist.barrier()
        replayed = []
        for shape, dtype, ranks, cp_rank, group, tag in self.exchanges:
            send, recv = torch.randn(shape).to(dtype), torch.empty(shape, dtype=dtype)
            start = time.monotonic()
            self._wait(self._post(send, recv, ranks, cp_rank, group, tag))
            replayed.append(time.monotonic() - start)
        posted = torch.tensor(self.posted, dtype=torch.float64)
        everyone = [torch.empty_like(posted) for _ in range(cp)]
        dist.all_gather(everyone, posted)
        me = dist.get_rank()
        exposed = 0.0
        for i, t in enumerate(replayed):
            begin, end = self.waits[i]
            moving = max(begin, float(everyone[me][i]), float(everyone[(me + 1) % cp][i]),
                         float(everyone[(me - 1) % cp][i]))
            exposed += min(t, max(0.0, end - moving))
        total = sum(replayed)
        return 1.0 - exposed / total, exposed, total


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
    """On every rank of one CP group: (a)'s search per comm type, then (b) and (c) at throughput_seq (None: the
    length CP 1 found)."""
    ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, 64 * 1024)
    cp = dist.get_world_size()
    state = build_parallel_state(cp=cp)
    quantum = QUANTUM * cp
    budget = a.budget_mib * 2**20

    def ready(comm_type):
        model_parallel_seed(1, 0, 0, state.cp_rank)
        model = build(a, quantum, comm_type, state.cp_group)
        step(model, quantum, cp, state.cp_rank, state.cp_group, 0)  # warm-up: gradients allocated, kernels loaded
        return model

    def fits(model, seq):
        peak = step(model, seq, cp, state.cp_rank, state.cp_group, seq)[0]
        return peak <= budget, peak

    found = {}
    for comm_type in (a.search_comm_types if cp > 1 else ["-"]):
        model = ready(comm_type if cp > 1 else "p2p")
        found[comm_type] = longest(lambda seq: fits(model, seq), a.start * cp, quantum)
    seq = throughput_seq or found["-"][0]
    rates = {}
    for comm_type in (COMM_TYPES if cp > 1 else ("-",)):
        model = ready(comm_type if cp > 1 else "p2p")
        with RingProbe() as probe:
            probe.active = comm_type == "p2p"
            times = [step(model, seq, cp, state.cp_rank, state.cp_group, 10 + r)[1] for r in range(a.reps)]
            probe.active = False
            overlap = None
            if comm_type == "p2p":
                mine = torch.tensor(probe.overlap(cp), dtype=torch.float64)
                lowest = mine[:1].clone()
                dist.all_reduce(lowest, op=dist.ReduceOp.MIN)
                overlap = (float(lowest[0]), float(mine[1]), float(mine[2]))
        rates[comm_type] = (statistics.median(times), overlap)
    return found, seq, rates


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget-mib", type=float, default=48.0, help="per-rank peak memory of a step, above its start")
    ap.add_argument("--cps", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--start", type=int, default=512, help="the search starts at this times CP tokens")
    ap.add_argument("--search-comm-types", choices=COMM_TYPES, nargs="+", default=["p2p", "a2a"])
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
    found, seq, base_rates = run_ranks(measure, 1, a, None, timeout=3600)[0]
    base_len, base_peak, base_over, base_probes = found["-"]
    base_step = base_rates["-"][0]
    print("\n(a) longest sequence within the budget\n")
    print("| CP | comm | longest | / CP1 | peak MiB there | first over | probes |")
    print("|---|---|---|---|---|---|---|")
    print(f"| 1 | - (SDPA) | {base_len} | 1.00 | {base_peak / 2**20:.1f} | {base_over} | {base_probes} |", flush=True)
    rows = []
    for cp in a.cps:
        found, _, rates = run_ranks(measure, cp, a, seq, timeout=3600)[0]
        for comm_type, (n, peak, over, probes) in found.items():
            print(f"| {cp} | {comm_type} | {n} | {n / base_len:.2f} | {peak / 2**20:.1f} | {over} | {probes} |",
                  flush=True)
        rows.append((cp, rates))
    print(f"\n(b) tokens/s at {seq} tokens (CP1's longest), (c) the p2p ring's overlap\n")
    print("| CP | comm | step s | tokens/s | / CP1 | ring overlap (lowest rank) | exposed s / replayed s (rank 0) |")
    print("|---|---|---|---|---|---|---|")
    print(f"| 1 | - (SDPA) | {base_step:.2f} | {seq / base_step:.0f} | 1.00 | | |")
    for cp, rates in rows:
        for comm_type, (t, overlap) in rates.items():
            ring = "|" if overlap is None else f"{overlap[0]:.2f} | {overlap[1]:.3f} / {overlap[2]:.3f}"
            print(f"| {cp} | {comm_type} | {t:.2f} | {seq / t:.0f} | {base_step / t:.2f} | {ring} |")
    print(f"\n# {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
