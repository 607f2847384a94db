"""All-reduce time of megatron_zero.distributed.shm_comm (shared memory + FIFO wake-ups) against gloo's, same ranks, same run.

    .venv/bin/python bench/bench_shm_all_reduce.py [--ranks 2] [--reps 3] [--calls 100]

Both run on the same 2-rank gloo group (run_ranks, one thread per rank), fp32 SUM of 4 KiB (a
cross-entropy statistic), 1 MiB (one tensor-parallel activation of the throughput benchmark:
micro-batch 4 x seq 256 x hidden 256) and 16 MiB (ZeRO's gradient all-reduce of that 4.3M-parameter
model); per size the two are interleaved `--reps` times. With 2 ranks, also the pipeline's exchange
(megatron_zero/pipeline/p2p.py, torch.distributed against shm_p2p.py): one call sends 1 MiB each way,
rank 0's send_forward_recv_backward against rank 1's send_backward_recv_forward. Reported: median wall
ms per call (rank 0) with the min-max over reps, and the CPU ms per call of rank 0's process (gloo's
threads included). Also the single-tensor collectives of ZeRO's gradient buckets and weight gather and of
sequence parallelism (shm_comm.reduce_scatter_tensor / all_gather_into_tensor against gloo's): a 16 MiB
reduce-scatter and an in-place 16 MiB all-gather.
"""
import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from megatron_zero.distributed import shm_comm  # noqa: E402
from megatron_zero.pipeline.p2p import P2P  # noqa: E402
from megatron_zero.distributed.reduce_scatter import all_gather_into_tensor, reduce_scatter_tensor  # noqa: E402
from megatron_zero.testing.multirank import run_ranks  # noqa: E402

SIZES = {"4 KiB": 1 << 10, "1 MiB": 1 << 18, "16 MiB": 1 << 22}
P2P_ROW = "p2p 1 MiB each way"
RS_ROW, AG_ROW = "reduce-scatter 16 MiB", "all-gather in place 16 MiB"


def timed(fn, x, calls):
    for _ in range(5):
        fn(x)
    dist.barrier()
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(calls):
        fn(x)
    return (time.perf_counter() - wall) / calls * 1e3, (time.process_time() - cpu) / calls * 1e3


def worker(reps, calls):
    group = dist.new_group(list(range(dist.get_world_size())))
    sides = {"gloo": lambda x: dist.all_reduce(x, group=group), "shm": lambda x: shm_comm.all_reduce(x, group)}
    rows = [(label, n, sides) for label, n in SIZES.items()]
    if dist.get_world_size() == 2:
        rows.append((P2P_ROW, SIZES["1 MiB"], p2p_sides(group)))
    rows += single_tensor_rows(group, SIZES["16 MiB"])
    out = {}
    for label, n, fns in rows:
        x = torch.randn(n)
        for rep in range(reps):
            for side in (("gloo", "shm") if rep % 2 == 0 else ("shm", "gloo")):
                out.setdefault((label, side), []).append(timed(fns[side], x, calls))
    return out


def single_tensor_rows(group, n):
    """ZeRO's bucket reduce-scatter and in-place weight all-gather of n fp32 elements, gloo and shared memory."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    out = torch.empty(n // world)
    rs = {"gloo": lambda x: reduce_scatter_tensor(out, x, group=group),
          "shm": lambda x: shm_comm.reduce_scatter_tensor(out, x, group)}
    ag = {"gloo": lambda x: all_gather_into_tensor(x, x.view(world, -1)[rank], group=group),
          "shm": lambda x: shm_comm.all_gather_into_tensor(x, x.view(world, -1)[rank], group)}
    return [(RS_ROW, n, rs), (AG_ROW, n, ag)]


def p2p_sides(group):
    """One 1 MiB activation / gradient swap between two pipeline stages, through gloo or shared memory."""
    first = dist.get_rank() == 0
    sides = {}
    for side, shm_group in (("gloo", None), ("shm", group)):
        p2p = P2P(None if first else 0, 1 if first else None, (SIZES["1 MiB"],), torch.float32, group=shm_group)
        sides[side] = p2p.send_forward_recv_backward if first else p2p.send_backward_recv_forward
    return sides


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--calls", type=int, default=100)
    a = ap.parse_args()
    res = run_ranks(worker, a.ranks, a.reps, a.calls, timeout=600)[0]
    print(f"{a.ranks} ranks, torch {torch.__version__}, {os.cpu_count()} cores; {a.reps} interleaved reps of "
          f"{a.calls} calls")
    print("| size | gloo ms (min-max) | shm ms (min-max) | gloo / shm | CPU ms gloo / shm |")
    print("|---|---|---|---|---|")
    for label in [*SIZES, *([P2P_ROW] if a.ranks == 2 else []), RS_ROW, AG_ROW]:
        g, s = ([w for w, _ in res[(label, side)]] for side in ("gloo", "shm"))
        gc, sc = (statistics.median(c for _, c in res[(label, side)]) for side in ("gloo", "shm"))
        print(f"| {label} | {statistics.median(g):.3f} ({min(g):.3f}-{max(g):.3f}) | {statistics.median(s):.3f} "
              f"({min(s):.3f}-{max(s):.3f}) | {statistics.median(g) / statistics.median(s):.2f} | "
              f"{gc:.3f} / {sc:.3f} |")


if __name__ == "__main__":
    main()
