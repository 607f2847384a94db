"""Muon against AdamW: bytes per parameter of bf16 ZeRO-1 on one rank, and Newton-Schulz's share of a step at
DP1, DP2 and DP4 (each matrix orthogonalized once, by the rank owning it: optimizer/muon_zero.py).

    .venv/bin/python bench/bench_muon.py [--layers 4] [--hidden 256] [--steps 4]

Bytes: the tensors a rank holds after two steps (ZeroOptimizer.memory_bytes): bf16 weights 2, the fp32 gradient
buffer 4, the fp32 master 4 and AdamW's two moments 8 (18) against Muon's one momentum 4 (14) on its matrices; the
whole model's figure mixes in the embeddings and norms, which stay with AdamW. Share: this rank's seconds in
Newton-Schulz (a host clock around it, `MuonStep.timed`) over the step's (forward, backward, optimizer), the
busiest rank's; the global batch is the same at every DP, so DP divides both the tokens and the matrices.
"""
import argparse
import os
import platform
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from megatron_zero.model.config import GPTConfig  # noqa: E402
from megatron_zero.model.gpt import GPTModel  # noqa: E402
from megatron_zero.optimizer.muon import MuonSettings, takes_muon  # noqa: E402
from megatron_zero.zero.build import param_groups  # noqa: E402
from megatron_zero.testing import run_ranks  # noqa: E402
from megatron_zero.zero import ZeroOptimizer  # noqa: E402

GLOBAL_BATCH, SEQ = 8, 64


def config(layers, hidden, dtype):
    return GPTConfig(vocab_size=1000, hidden_size=hidden, num_layers=layers, num_attention_heads=4, seq_length=SEQ,
                     max_position_embeddings=SEQ, make_vocab_size_divisible_by=8, hidden_dropout=0.0,
                     attention_dropout=0.0, params_dtype=dtype)


def optimizer(model, muon: bool, dtype: str):
    settings = MuonSettings(nesterov=True, fp32_matmul_prec="highest", tp_mode="duplicated",
                            qkv_split_rows=(model.config.head_dim,) * 3) if muon else None
    return ZeroOptimizer(param_groups(model, 0.01, muon=muon), dp_group=dist.group.WORLD, stage=1, lr=1e-3,
                         weight_decay=0.01, module=model, dtype=dtype, muon=settings)


def step(model, opt, it):
    dp, rank = dist.get_world_size(), dist.get_rank()
    tokens = torch.randint(0, 1000, (GLOBAL_BATCH, SEQ + 1), generator=torch.Generator().manual_seed(it))
    mine = tokens[rank * GLOBAL_BATCH // dp:(rank + 1) * GLOBAL_BATCH // dp]
    opt.backward(model(mine[:, :-1], labels=mine[:, 1:]))
    opt.step()


def memory(layers, hidden):
    out = {}
    for muon in (False, True):
        model = GPTModel(config(layers, hidden, torch.bfloat16))
        opt = optimizer(model, muon, "bf16")
        for it in range(2):
            step(model, opt, it)
        psi = sum(p.numel() for p in model.parameters())
        matrices = sum(p.numel() for n, p in model.named_parameters() if takes_muon(n, p.shape))
        out[muon] = dict(opt.memory_bytes(), psi=psi, matrices=matrices)
    return out


def share(layers, hidden, steps):
    model = GPTModel(config(layers, hidden, torch.float32))
    opt = optimizer(model, True, "fp32")
    step(model, opt, 0)  # warm-up
    opt.muon.timed, opt.muon.ns_seconds = True, 0.0
    dist.barrier()
    start = time.perf_counter()
    for it in range(1, steps + 1):
        step(model, opt, it)
    seconds = (time.perf_counter() - start) / steps
    return {"ns": opt.muon.ns_seconds / steps, "step": seconds, "flops": opt.muon.work()["flops_per_rank"][0]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--steps", type=int, default=4)
    a = ap.parse_args()
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}")
    res = run_ranks(memory, 1, a.layers, a.hidden, timeout=600)[0]
    psi, matrices = res[True]["psi"], res[True]["matrices"]
    print(f"GPT {a.layers} layers, hidden {a.hidden}, vocabulary 1000: {psi:,} parameters, {matrices:,} in the "
          f"blocks' matrices (Muon's); bf16 weights, ZeRO-1 on one rank; bytes per parameter")
    print("| optimizer | params | grads | optimizer state | total | the matrices' optimizer state |")
    print("|---|---|---|---|---|---|")
    for muon, r in res.items():
        total = (r["params"] + r["grads"] + r["optimizer_state"]) / psi
        rest = psi - matrices  # AdamW's: 12 bytes each (master and two moments)
        on_matrices = (r["optimizer_state"] - 12 * rest) / matrices
        print(f"| {'Muon' if muon else 'AdamW'} | {r['params'] / psi:.2f} | {r['grads'] / psi:.2f} | "
              f"{r['optimizer_state'] / psi:.2f} | {total:.2f} | {on_matrices:.2f} |")
    print()
    print(f"Newton-Schulz's share of a Muon step (fp32, global batch {GLOBAL_BATCH} x {SEQ}, {a.steps} steps; "
          "seconds on the busiest rank)")
    print("| DP | Newton-Schulz s / step | step s | share | Newton-Schulz GFLOP per rank |")
    print("|---|---|---|---|---|")
    for dp in (1, 2, 4):
        ranks = run_ranks(share, dp, a.layers, a.hidden, a.steps, timeout=900)
        ns, total = max(r["ns"] for r in ranks), max(r["step"] for r in ranks)
        flops = "/".join(f"{f / 1e9:.2f}" for f in ranks[0]["flops"])
        print(f"| {dp} | {ns:.4f} | {total:.4f} | {ns / total:.2f} | {flops} |")


if __name__ == "__main__":
    main()
