"""Mixture of experts: training throughput against the dense model of equal active parameters, the cost of
dispatch per token as the number of experts E and top-k grow, and each rank's memory by expert parallelism.

    .venv/bin/python bench/bench_moe.py [--reps 5] [--tables a,b,c,d] [--threads 1]

(a) tokens/s of a training step (forward to the loss, backward, AdamW) of the single-process model, GPT-2
    (GeLU experts) and Llama (SwiGLU experts, RMSNorm, RoPE, grouped-query attention): MoE in every layer,
    --experts experts of width --ffn, top-k, aux loss on, --moe-grouped-gemm; the baseline is the dense
    model whose MLP is k x --ffn wide (the same active parameters per token: k experts of width F against
    one MLP of width k F), everything else equal. The two models' steps alternate (one warm-up each), so both
    share the machine's noise; the median over --reps steps.
(b) dispatch, timed alone, forward and backward, in two parts: the router (logits x W_g^T, top-k and softmax,
    the aux loss's softmax over all E: h E + O(E) operations a token, the part that must grow with E), and
    the move (the per-expert counts, permute, the all-to-all to the experts' owners and back, unpermute with
    the router weights; the experts left out, rows return unchanged), on 2 gloo ranks at EP2 (counts
    exchange and variable-split all_to_all_single) and at EP1 (no exchange). --tokens tokens a rank, over
    E = 4..64 at k = 2, then over k = 1..8 at E = 64. Microseconds per token, the slowest rank, the fastest
    of --reps runs with the rows' runs interleaved (on a shared machine the medians of these millisecond
    runs move several-fold with the load; the fastest is the least disturbed); the baseline is the first
    row of each sweep. The move handles T k rows whatever E is: flat in E at fixed T k, linear in k. Beside
    it, the experts' own compute on the same rows (the per-expert loop of grouped_mlp.py, what runs on the
    CPU and wherever grouped_mm does not): the same FLOPs at every E, one pair of matmuls per expert.
(c) memory by EP on 4 gloo ranks (DP 4, expert parallelism carved out of it), the same Llama MoE, ZeRO
    stage 0 (every rank keeps the Adam moments of what it holds) and 1: bytes of parameters, gradients and
    optimizer state (fp32 master where kept, exp_avg, exp_avg_sq) a rank holds after a step (ZeroOptimizer's
    own count), and the step's peak resident memory above the process's before the model was built
    (VmHWM, glibc serving allocations above 64 KiB by mmap so that freed memory leaves the process). The
    baseline is EP1.
(d) the bytes of expert weights the grouped GEMM copies a forward (CopyCounter, the experts of every MoE
    layer on --tokens rows split evenly), GPT-2 and Llama MoE, forced onto grouped_mm (its CPU forward, no
    grad: the CPU has no grouped_mm backward): the experts as separate tensors (no ZeRO wrapper: stacked by a
    copy, what every forward did under every stage before) against ZeRO-1's flat buffer and ZeRO-3's gathered
    storage (the stacked view, stacked_weights.py; ZeRO-3 on one process, the experts gathered with their
    layer as its forward hook does, persistence threshold 0, the gather itself not counted). The baseline is
    the separate tensors; the experts' parameter bytes beside.
Ranks and threads share the machine's cores: on a 2-core machine the EP2 rows' alltoall competes with compute.
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
import torch.nn.functional as F  # noqa: E402

from megatron_zero.model.config import GPTConfig  # noqa: E402
from megatron_zero.model.gpt import reference_model  # noqa: E402
from megatron_zero.model.transformer import ParallelMLP  # noqa: E402
from megatron_zero.moe import reset_aux_losses, set_aux_loss_scale  # noqa: E402
from megatron_zero.moe.dispatch import ExpertParallelExchange, permute, unpermute  # noqa: E402
from megatron_zero.moe.grouped_mlp import GroupedMLP  # noqa: E402
from megatron_zero.moe.layer import Experts  # noqa: E402
from megatron_zero.moe.router import route  # noqa: E402
from megatron_zero.pipeline.gpt_stage import build_gpt_stage  # noqa: E402
from megatron_zero.testing import run_ranks  # noqa: E402
from megatron_zero.testing.copy_counter import CopyCounter  # noqa: E402
from megatron_zero.testing.tiny_gpt import LLAMA_ARCHITECTURE  # noqa: E402
from megatron_zero.distributed.topology import build_parallel_state  # noqa: E402
from megatron_zero.zero import ZeroOptimizer  # noqa: E402

M_MMAP_THRESHOLD = -3
EXPERT_SWEEP = (4, 8, 16, 32, 64)
TOPK_SWEEP = (1, 2, 4, 8)
MIB = 2 ** 20


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tables", default="a,b,c,d",
                   help="which tables: a (throughput), b (dispatch), c (memory), d (grouped GEMM weight copies)")
    p.add_argument("--reps", type=int, default=7, help="timed repetitions per row")
    p.add_argument("--threads", type=int, default=1, help="torch threads per process")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=4, help="samples per step in (a) and (c)")
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--experts", type=int, default=8, help="experts in (a) and (c)")
    p.add_argument("--ffn", type=int, default=256, help="an expert's width; the dense baseline's is k x this")
    p.add_argument("--topk", type=int, default=2)
    p.add_argument("--tokens", type=int, default=4096, help="tokens a rank routes in (b)")
    a = p.parse_args(argv)
    tables = set(a.tables.split(","))
    if not tables <= {"a", "b", "c", "d"}:
        p.error(f"--tables {a.tables}: a comma-separated subset of a, b, c, d")
    if a.reps < 1 or a.experts % 4 or not 1 <= a.topk <= a.experts:
        p.error("--reps must be at least 1, --experts a multiple of 4 (EP 1, 2 and 4) and --topk in 1..--experts")
    a.tables = tables
    return a


def config(a, moe: bool, llama: bool, experts=None, **extra) -> GPTConfig:
    arch = dict(LLAMA_ARCHITECTURE, num_query_groups=a.heads // 2) if llama else {}
    fields = dict(vocab_size=a.vocab, hidden_size=a.hidden, num_layers=a.layers, num_attention_heads=a.heads,
                  seq_length=a.seq, max_position_embeddings=a.seq, hidden_dropout=0.0, attention_dropout=0.0,
                  ffn_hidden_size=a.ffn if moe else a.ffn * a.topk, **arch)
    if moe:
        fields.update(num_experts=experts or a.experts, moe_router_topk=a.topk, moe_aux_loss_coeff=1e-2,
                      moe_grouped_gemm=True)
    return GPTConfig(**fields, **extra)


def batch(a, seed):
    tokens = torch.randint(0, a.vocab, (a.batch, a.seq + 1), generator=torch.Generator().manual_seed(seed))
    return tokens[:, :-1], tokens[:, 1:].contiguous()


def active_params(model, cfg) -> int:
    """Parameters a token goes through: all but the experts a token is not routed to."""
    total = sum(p.numel() for p in model.parameters())
    if cfg.num_experts is None:
        return total
    expert = sum(p.numel() for n, p in model.named_parameters() if ".deepspeed_experts.0." in n)
    return total - expert * (cfg.num_experts - cfg.moe_router_topk)


def throughput(a):
    """(a): rows of (model, active params of MoE and dense, tokens/s of each, ratio)."""
    rows = []
    for llama in (False, True):
        runs = {}
        for moe in (True, False):
            cfg = config(a, moe, llama)
            torch.manual_seed(0)
            model = reference_model(cfg)
            runs[moe] = (cfg, model, torch.optim.AdamW(model.parameters(), lr=1e-4), [])
        set_aux_loss_scale(1.0)
        for rep in range(a.reps + 1):
            for moe, (cfg, model, opt, times) in runs.items():
                tokens, labels = batch(a, rep)
                start = time.perf_counter()
                model(tokens, labels=labels).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                if rep:  # the first is a warm-up
                    times.append(time.perf_counter() - start)
        reset_aux_losses()
        speed = {moe: a.batch * a.seq / statistics.median(r[3]) for moe, r in runs.items()}
        active = {moe: active_params(r[1], r[0]) for moe, r in runs.items()}
        rows.append(("Llama" if llama else "GPT", active[True], active[False], speed[True], speed[False],
                     speed[True] / speed[False]))
    return rows


def router_once(x, wg, topk):
    """The router: logits, top-k and softmax, the aux loss (softmax over all E); forward and backward."""
    weights, _ = route(F.linear(x, wg).float(), topk, False, "aux_loss", 1e-2, None)
    weights.sum().backward()


def move_once(x, weights, ids, experts, group, local):
    """The per-expert counts, permute, the alltoall there and back (`group` None: none), unpermute with the
    router weights; forward and backward."""
    counts = torch.bincount(ids.reshape(-1), minlength=experts)
    if group is None:
        rows, order, token_of_row = permute(x, ids, int(counts.sum()))
        out = rows
    else:
        exchange = ExpertParallelExchange(counts, group, local)
        rows, order, token_of_row = permute(x, ids, sum(exchange.send))
        out = exchange.from_experts(exchange.to_experts(rows))
    unpermute(out, weights, order, token_of_row, x.shape[0]).sum().backward()


def interleaved(fns, reps, group=None):
    """Seconds of each of fns: the fastest of `reps` runs after a warm-up, the runs of all fns interleaved
    (each rep runs every fn once), so that the machine's load falls on every row alike; with `group`, each
    run starts at a barrier and the slowest rank's time counts."""
    for fn in fns:
        fn()
    best = [float("inf")] * len(fns)
    for _ in range(reps):
        for i, fn in enumerate(fns):
            if group is not None:
                dist.barrier(group)
            start = time.perf_counter()
            fn()
            best[i] = min(best[i], time.perf_counter() - start)
    t = torch.tensor(best, dtype=torch.float64)
    if group is not None:
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.tolist()


def dispatch_rank(a, sweep):
    """On each of 2 ranks: [(E, k, tokens, router s, EP1 move s, EP2 move s)] for every (E, k) of the sweep."""
    torch.set_num_threads(a.threads)
    group = dist.group.WORLD
    ep = dist.get_world_size()
    fns = []
    for experts, topk, tokens in sweep:
        g = torch.Generator().manual_seed(dist.get_rank())
        x = torch.randn(tokens, a.hidden, generator=g).requires_grad_()
        wg = (torch.randn(experts, a.hidden, generator=g) / a.hidden ** 0.5).requires_grad_()
        with torch.no_grad():
            weights, ids = route(F.linear(x, wg).float(), topk, False, "none", 0.0, None)
        weights.requires_grad_()
        fns += [lambda x=x, wg=wg, k=topk: router_once(x, wg, k),
                lambda x=x, w=weights, i=ids, e=experts: move_once(x, w, i, e, None, e),
                lambda x=x, w=weights, i=ids, e=experts: move_once(x, w, i, e, group, e // ep)]
    times = interleaved(fns, a.reps, group)
    reset_aux_losses()
    return [row + tuple(times[3 * i:3 * i + 3]) for i, row in enumerate(sweep)]


def expert_compute(a, sweep):
    """Seconds of the per-expert loop (grouped_mlp.py's CPU path) forward and backward on tokens x k rows
    spread evenly over E experts of width --ffn (GeLU, with biases), for every (E, k, tokens) of the sweep."""
    fns = []
    for experts, topk, tokens in sweep:
        torch.manual_seed(0)
        module = Experts(config(a, True, False, experts=experts), None, range(experts), ParallelMLP)
        rows = torch.randn(tokens * topk, a.hidden).requires_grad_()
        counts = [tokens * topk // experts] * experts
        counts[-1] += tokens * topk - sum(counts)
        fns.append(lambda m=module, r=rows, c=counts: m(r, c).sum().backward())
    return interleaved(fns, a.reps)


def dispatch_tables(a):
    sweep = [(e, a.topk, a.tokens) for e in EXPERT_SWEEP] + [(max(EXPERT_SWEEP), k, a.tokens) for k in TOPK_SWEEP]
    measured = run_ranks(dispatch_rank, 2, a, sweep, timeout=900)[0]
    torch.set_num_threads(a.threads)
    return [row + (t,) for row, t in zip(measured, expert_compute(a, sweep))]


def _vmhwm_reset():
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _status(key):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {key}")


def memory_rank(a, ep, stage):
    """One rank of 4 at EP `ep`: (params, grads, optimizer state bytes after a step, peak RSS growth)."""
    torch.set_num_threads(a.threads)
    ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, 64 * 1024)
    gc.collect()
    before = _status("VmRSS")
    _vmhwm_reset()
    state = build_parallel_state(ep=ep)
    cfg = config(a, True, True)
    model = build_gpt_stage(cfg, state)
    opt = ZeroOptimizer(list(model.named_parameters()), dp_group=state.dp_group, stage=stage, lr=1e-4,
                        mp_group=state.mp_group, tp_rank=state.tp_rank, module=model,
                        expert_dp_group=state.expert_dp_group)
    set_aux_loss_scale(1.0)
    tokens, labels = batch(a, dist.get_rank())
    opt.backward(model(tokens, labels=labels))
    grads = opt.memory_bytes()["grads"]
    opt.step()
    held = opt.memory_bytes()
    reset_aux_losses()
    peak = _status("VmHWM") - before
    result = torch.tensor([held["params"], grads, held["optimizer_state"], peak], dtype=torch.float64)
    dist.all_reduce(result, op=dist.ReduceOp.MAX)
    return [int(v) for v in result]


def memory_table(a):
    return [(stage, ep, *run_ranks(memory_rank, 4, a, ep, stage, timeout=900)[0])
            for stage in (0, 1) for ep in (1, 2, 4)]


def _experts_forward(layers, x, counts, stage):
    """Bytes copied by the forwards of every MoE layer's experts; ZeRO-3 (`stage`): each gathered with its unit."""
    with torch.no_grad():
        copied = 0
        for experts in layers:
            ui = next((i for i, u in enumerate(stage.units) if experts in set(u.modules())), None) if stage else None
            if ui is not None:
                stage.gather_unit(ui)
            with CopyCounter() as copies:
                experts(x, counts)
            copied += copies.total
            if ui is not None:
                stage.release_unit(ui)
    return copied


def weight_copies(a):
    """(d): rows of (model, expert parameter bytes, bytes copied a forward: separate tensors, ZeRO-1, ZeRO-3)."""
    rows, grouped = [], GroupedMLP.uses_grouped_mm
    GroupedMLP.uses_grouped_mm = lambda self, experts, rows: True
    try:
        for llama in (False, True):
            cfg = config(a, True, llama)
            model = reference_model(cfg)
            layers = [m for m in model.modules() if isinstance(m, Experts)]
            x = torch.randn(a.tokens, a.hidden, generator=torch.Generator().manual_seed(0))
            counts = [a.tokens // a.experts] * (a.experts - 1) + [a.tokens - a.tokens // a.experts * (a.experts - 1)]
            held = sum(p.numel() * p.element_size() for m in layers for p in m.parameters())
            copied = [_experts_forward(layers, x, counts, None)]
            for stage in (1, 3):
                model = reference_model(cfg)
                layers = [m for m in model.modules() if isinstance(m, Experts)]
                zero = ZeroOptimizer(list(model.named_parameters()), stage=stage, module=model, persistence_threshold=0)
                copied.append(_experts_forward(layers, x, counts, zero.impl if stage == 3 else None))
            rows.append(("Llama" if llama else "GPT-2", held, *copied))
    finally:
        GroupedMLP.uses_grouped_mm = grouped
    return rows


def machine() -> str:
    return (f"# {platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
            f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, load {os.getloadavg()[0]:.2f}")


def main(argv=None):
    a = parse(argv)
    torch.set_num_threads(a.threads)
    print(machine())
    print(f"# {a.layers} layers, hidden {a.hidden}, {a.heads} heads, seq {a.seq}, batch {a.batch}, vocab {a.vocab}; "
          f"MoE: {a.experts} experts of ffn {a.ffn}, top-{a.topk}, grouped GEMM; dense: ffn {a.ffn * a.topk}; "
          f"fp32, {a.threads} thread(s) a process, {a.reps} reps")
    if "a" in a.tables:
        print("\n(a) training step tokens/s: MoE against the dense model of equal active parameters")
        print("| model | active params MoE | active params dense | MoE tokens/s | dense tokens/s | MoE / dense |")
        print("|---|---:|---:|---:|---:|---:|")
        for name, am, ad, sm, sd, r in throughput(a):
            print(f"| {name} | {am:,} | {ad:,} | {sm:,.0f} | {sd:,.0f} | {r:.2f} |")
    if "b" in a.tables:
        rows = dispatch_tables(a)
        print(f"\n(b) dispatch per token, forward and backward, {a.tokens} tokens a rank: the router, and the "
              "permutation with (EP2) or without (EP1) the all-to-all; the experts' compute (per-expert loop) beside it")
        print("| E | k | router us/token | / first row | EP1 permute + unpermute us/token | / first row | "
              "EP2 permute + alltoall + unpermute us/token | / first row | experts us/token | / first row |")
        print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for i, (e, k, t, *times) in enumerate(rows):
            base = rows[0] if i < len(EXPERT_SWEEP) else rows[len(EXPERT_SWEEP)]
            if i == len(EXPERT_SWEEP):
                print("|" + " |" * 10)
            print(f"| {e} | {k} | " + " | ".join(f"{v / t * 1e6:.2f} | {v / b:.2f}" for v, b in zip(times, base[3:]))
                  + " |")
    if "c" in a.tables:
        print(f"\n(c) memory a rank holds (MiB; the largest rank) by EP, 4 ranks (DP 4), Llama MoE "
              f"{a.experts} experts; ratio: optimizer state and peak to EP1's")
        print("| ZeRO | EP | params | grads | optimizer state | step peak RSS | state / EP1 | peak / EP1 |")
        print("|---:|---:|---:|---:|---:|---:|---:|---:|")
        rows = memory_table(a)
        for stage, ep, params, grads, state, peak in rows:
            base = next(r for r in rows if r[0] == stage and r[1] == 1)
            print(f"| {stage} | {ep} | {params / MIB:.2f} | {grads / MIB:.2f} | {state / MIB:.2f} | {peak / MIB:.1f} | "
                  f"{state / base[4]:.2f} | {peak / base[5]:.2f} |")
    if "d" in a.tables:
        print(f"\n(d) expert weight bytes the grouped GEMM copies a forward ({a.layers} MoE layers, {a.tokens} rows "
              "each): separate tensors (stacked by a copy) against ZeRO-1's flat buffer and ZeRO-3's gathered "
              "storage (views)")
        print("| model | expert param bytes | copied: separate tensors | copied: ZeRO-1 | copied: ZeRO-3 |")
        print("|---|---:|---:|---:|---:|")
        for name, held, before, zero1, zero3 in weight_copies(a):
            print(f"| {name} | {held:,} | {before:,} | {zero1:,} | {zero3:,} |")


if __name__ == "__main__":
    main()
