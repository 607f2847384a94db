"""Activation bytes copied per transformer layer by the sequence-parallel collectives, before and after they
became copy-free (tensor_parallel/mappings.py), same ranks, same run.

    .venv/bin/python bench/bench_sp_copies.py [--micro-batch 4] [--seq 256] [--hidden 256] [--reps 5]

One ParallelTransformerLayer with --sequence-parallel at TP2 (two gloo ranks on the CPU, run_ranks), fp32,
forward + backward of a [b, s/2, h] shard. Two variants of the three token collectives the layer runs
(two all-gathers and two reduce-scatters forward, the same backward):

  list form (the code before): all-gather into a list of chunks + torch.cat along the sequence; the
    reduce-scatter's input cut with .chunk(dim=1).contiguous() (+ the split's .contiguous());
  in place (now): all_gather_into_tensor / reduce_scatter_tensor between the shard and the whole,
    the tokens split in memory order (a view).

Reported per layer (rank 0): MiB written by copying aten ops (CopyCounter: cat, clone, copy_, _to_copy;
not the backends' transport) inside the collectives and in the whole layer, counted with shared memory
off (gloo's collectives, whose transport is off this thread); and the median wall ms of forward +
backward over --reps, with the default communication (shared memory on one host), the two variants
interleaved.
"""
import argparse
import functools
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from megatron_zero.distributed import shm_comm  # noqa: E402
from megatron_zero.tensor_parallel import mappings  # noqa: E402
from megatron_zero.tensor_parallel.conjugate import conjugate_pair  # noqa: E402
from megatron_zero.tensor_parallel.utils import split_along_dim, tp_rank_in, tp_world_size  # noqa: E402
from megatron_zero.testing.copy_counter import CopyCounter  # noqa: E402
from megatron_zero.testing.multirank import run_ranks  # noqa: E402

MIB = 1 << 20


# ---- the list-form collectives, as the mappings had them (split along the sequence, dim 1) ----------
def _split_list_form(x, group):
    return split_along_dim(x, tp_world_size(group), tp_rank_in(group), dim=1)


def _gather_list_form(x, group):
    parts = [torch.empty_like(x, memory_format=torch.contiguous_format) for _ in range(tp_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=1)


def _reduce_scatter_list_form(x, group):
    parts = [p.contiguous() for p in x.chunk(tp_world_size(group), dim=1)]
    out = torch.empty_like(parts[0])
    mappings.reduce_scatter(out, parts, group=group)
    return out


VARIANTS = {
    "list form (before)": (_split_list_form, _gather_list_form, _reduce_scatter_list_form),
    "in place (now)": (mappings._split_tokens, mappings._gather_tokens, mappings._reduce_scatter_tokens),
}


def use(variant, inside):
    """Install a variant's three collectives in mappings' sequence-parallel autograd functions (built from them
    as mappings.py builds its own, conjugate_pair), each counting its copies into `inside`."""
    def counted(fn):
        @functools.wraps(fn)
        def call(*args):
            with CopyCounter() as copies:
                out = fn(*args)
            inside.append(copies.total)
            return out
        return call
    split, gather, reduce_scatter = (counted(fn) for fn in VARIANTS[variant])
    mappings._ScatterToSequenceParallel, mappings._GatherFromSequenceParallel = conjugate_pair(split, gather)
    mappings._ReduceScatterToSequenceParallel, mappings._GatherPartialFromSequenceParallel = conjugate_pair(
        reduce_scatter, gather)


def layer_fn(micro, seq, hidden, reps):
    from megatron_zero.model.config import GPTConfig
    from megatron_zero.model.transformer import ParallelTransformerLayer
    from megatron_zero.distributed.topology import build_parallel_state
    state = build_parallel_state(tp=2)
    config = GPTConfig(vocab_size=1024, hidden_size=hidden, num_layers=1, num_attention_heads=8, seq_length=seq,
                       max_position_embeddings=seq, hidden_dropout=0.0, attention_dropout=0.0, sequence_parallel=True)
    layer = ParallelTransformerLayer(config, state.tp_group)
    x = torch.randn(micro, seq // 2, hidden, generator=torch.Generator().manual_seed(dist.get_rank()))

    def step():
        y = layer(x.clone().requires_grad_())
        y.backward(torch.ones_like(y))

    out = {}
    shm_comm.set_shared_memory_comm(False)  # counting: gloo's collectives (transport off this thread)
    for variant in VARIANTS:
        inside = []
        use(variant, inside)
        with CopyCounter() as whole:
            step()
        if not inside:
            raise SystemExit(f"bench: the {variant} collectives were not called; mappings.py no longer runs the "
                             "autograd functions this bench replaces")
        out[variant] = {"inside": sum(inside) / MIB, "whole": whole.total / MIB, "ms": []}
    shm_comm.set_shared_memory_comm(True)  # timing: the default communication
    for _ in range(reps):
        for variant in VARIANTS:
            use(variant, [])
            step()
            dist.barrier()
            t = time.perf_counter()
            step()
            out[variant]["ms"].append((time.perf_counter() - t) * 1e3)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args()
    res = run_ranks(layer_fn, 2, a.micro_batch, a.seq, a.hidden, a.reps, timeout=900)[0]
    act = a.micro_batch * a.seq * a.hidden * 4 / MIB
    print(f"TP2 sequence-parallel layer, [b, s, h] = [{a.micro_batch}, {a.seq}, {a.hidden}] fp32 "
          f"({act:.2f} MiB gathered activation), forward + backward, rank 0, torch {torch.__version__}\n")
    print("| collectives | MiB copied in SP collectives | MiB copied in the layer | ms per layer (median) |")
    print("|---|---|---|---|")
    for variant, r in res.items():
        print(f"| {variant} | {r['inside']:.2f} | {r['whole']:.2f} | {statistics.median(r['ms']):.1f} |")


if __name__ == "__main__":
    main()
