"""Bytes each rank holds per ZeRO stage: in fp32 beside the ZeRO paper's formulas, and in bf16 as bytes per
parameter beside Megatron-Core's distributed optimizer, on one rank and on N.

    .venv/bin/python bench/bench_zero_memory.py [--dp 2] [--layers 4] [--hidden 128]

Measured on the CPU by summing the bytes of the tensors a rank holds (ZeroOptimizer.memory_bytes, every
tensor counted once however many views it has): model parameters (peak during a step for stage 3),
gradients (the larger of what is held after backward and what is held after the step plus the peak of
transient gradient tensors: ZeRO-2's open buckets, the contiguous copies a bucket of the fp32 buffer is
reduce-scattered from), optimizer state (fp32 master + exp_avg + exp_avg_sq).
Paper (Rajbhandari et al. 2019, fig. 1) with mixed precision: stage 1: 2Ψ + 2Ψ + KΨ/N, stage 2: 2Ψ +
(2+K)Ψ/N, stage 3: (2+2+K)Ψ/N, K = 12. In fp32 the weights and gradients are 4 bytes: params 4Ψ (4Ψ/N at
stage 3), grads 4Ψ (4Ψ/N at stage 2/3), optimizer 12Ψ/N (master, m, v; the paper's K without the fp16 copy).
bf16 with fp32 gradient accumulation, per parameter: Megatron-Core's distributed optimizer (its ZeRO-1) holds
2 (bf16 weights) + 4 (the fp32 gradient buffer, reduce-scattered in place) + 12/N (fp32 master and moments);
plain data parallelism (our stage 0) 2 + 4 + 12 = 18.

`--fp8`: the weights' bytes with --fp8-param-gather (bf16, the blocks' linear layers in FP8, emulated) after a
step at ZeRO-1 and ZeRO-3, counted from the live tensors (megatron_zero/testing/live_bytes.py: the storages of
the model's parameters, buffers and FP8 weights, and ZeRO-3's shards), per parameter of the model and per
element of the FP8 layers' weights. Run it on an earlier commit's tree (its bench/ directory) for the "before".
"""
import argparse
import os
import platform
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from megatron_zero.model.config import GPTConfig  # noqa: E402
from megatron_zero.model.gpt import GPTModel  # noqa: E402
from megatron_zero.testing import run_ranks  # noqa: E402
from megatron_zero.zero import ZeroOptimizer  # noqa: E402


def config(layers, hidden, dtype="fp32"):
    return GPTConfig(vocab_size=1000, hidden_size=hidden, num_layers=layers, num_attention_heads=4, seq_length=64,
                     max_position_embeddings=64, make_vocab_size_divisible_by=8, hidden_dropout=0.0,
                     attention_dropout=0.0, params_dtype=torch.bfloat16 if dtype == "bf16" else torch.float32)


def measure(layers, hidden, bucket, dtype="fp32"):
    rank = dist.get_rank()
    out = {}
    for stage in (0, 1, 2, 3):
        model = GPTModel(config(layers, hidden, dtype))
        psi = sum(p.numel() for p in model.parameters())
        layer = max(sum(p.numel() for p in m.parameters()) for n, m in model.named_children() if n.isdigit())
        opt = ZeroOptimizer(list(model.named_parameters()), dp_group=dist.group.WORLD, stage=stage,
                            bucket_size=bucket, module=model, lr=1e-3, dtype=dtype)
        tokens = torch.randint(0, 1000, (2, 65), generator=torch.Generator().manual_seed(rank))
        peak_params = 0
        for _ in range(2):
            loss = model(tokens[:, :-1], labels=tokens[:, 1:])
            opt.backward(loss)
            grads = opt.memory_bytes()["grads"]
            opt.step()
        held = opt.memory_bytes()
        impl = opt.impl
        if stage == 3:
            size = 2 if dtype == "bf16" else 4
            peak_params = sum(p.ds_shard.numel() * size for g in impl.groups for p in g) + impl.peak_param_numel * size
        else:
            peak_params = held["params"]
        peak_grads = max(grads, held["grads"] + impl.peak_grad_numel * 4)
        out[stage] = dict(psi=psi, layer=layer, params=peak_params, grads=peak_grads, optim=held["optimizer_state"])
    return out


def measure_fp8(layers, hidden):
    """-> {stage: (weight bytes / Ψ, (bytes of the FP8 layers' weights) / (their elements))} after one step."""
    from megatron_zero.fp8.convert import Float8Converter
    from megatron_zero.fp8.settings import Float8Settings
    from megatron_zero.testing.live_bytes import storage_bytes, weight_bytes

    rank, out = dist.get_rank(), {}
    for stage in (1, 3):
        torch.manual_seed(0)
        model = GPTModel(config(layers, hidden, "bf16"))
        converter = Float8Converter(Float8Settings("hybrid", "tensorwise", 0, True, param_gather=True),
                                    torch.device("cpu"))
        converter.convert(model)
        opt = ZeroOptimizer(list(model.named_parameters()), dp_group=dist.group.WORLD, stage=stage, module=model,
                            lr=1e-3, dtype="bf16",
                            fp8_gather=converter.weight_gather(model, dist.group.WORLD, torch.device("cpu")))
        tokens = torch.randint(0, 1000, (2, 65), generator=torch.Generator().manual_seed(rank))
        opt.backward(model(tokens[:, :-1], labels=tokens[:, 1:]))
        opt.step()
        fp8 = [m for m in model.modules() if getattr(getattr(m, "fp8", None), "param_gather", False)]
        params = [p for g in opt.impl.groups for p in g] if stage == 3 else []
        shards = list(getattr(opt.impl, "shards", [])) + [getattr(p, "ds_shard8", None) for p in params]
        psi = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
        numel = sum(getattr(m.weight, "ds_numel", m.weight.numel()) for m in fp8)
        # the FP8 layers' weights: their bf16 weights or shards, their FP8 weights or FP8 shards
        own = [m.weight for m in fp8] + [m.fp8.weight8.data for m in fp8]
        if stage == 3:
            own = [p.ds_shard for p in params if any(p is m.weight for m in fp8) and p.ds_shard is not None] + \
                [p.ds_shard8 for p in params if getattr(p, "ds_shard8", None) is not None]
        held = sum(t.numel() * t.element_size() for t in own if t.untyped_storage().nbytes() > t.element_size())
        out[stage] = (weight_bytes(model, shards) / psi, held / numel, storage_bytes(model.buffers()) / psi)
    return out


def formulas(stage, psi, n, layer):
    params = 4 * psi if stage < 3 else 4 * psi / n + 4 * layer
    grads = 4 * psi if stage < 2 else 4 * psi / n
    optim = 12 * psi if stage == 0 else 12 * psi / n
    return params, grads, optim


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--bucket", type=int, default=200_000)
    ap.add_argument("--fp8", action="store_true", help="the weights' bytes with --fp8-param-gather only")
    a = ap.parse_args()
    if a.fp8:
        for n in sorted({1, a.dp}):
            for stage, (per_param, per_fp8, buffers) in run_ranks(measure_fp8, n, a.layers, a.hidden,
                                                                   timeout=600)[0].items():
                print(f"| {n} | {stage} | {per_param:.2f} | {per_fp8:.2f} | (buffers {buffers:.2f}) |")
        return
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}")
    res = run_ranks(measure, a.dp, a.layers, a.hidden, a.bucket, timeout=600)[0]
    psi, layer = res[0]["psi"], res[0]["layer"]
    print(f"GPT {a.layers} layers, hidden {a.hidden}: Ψ = {psi:,} params, largest layer {layer:,}; DP = {a.dp}; "
          f"fp32; bucket {a.bucket:,} elements; MB = 2**20 bytes, rank 0")
    print("| stage | params MB (paper) | grads MB (paper) | optimizer MB (paper) | optimizer / (12Ψ/N) |")
    print("|---|---|---|---|---|")
    mb = 2 ** 20
    for stage, r in res.items():
        fp, fg, fo = formulas(stage, psi, 1 if stage == 0 else a.dp, layer)
        print(f"| {stage} | {r['params'] / mb:.2f} ({fp / mb:.2f}) | {r['grads'] / mb:.2f} ({fg / mb:.2f}) | "
              f"{r['optim'] / mb:.2f} ({fo / mb:.2f}) | {r['optim'] / (12 * psi / a.dp):.4f} |")
    print()
    print(f"bf16 weights, fp32 gradient accumulation; bytes per parameter (Ψ = {psi:,}); Megatron-Core's distributed "
          "optimizer at stage 1, plain data parallelism at stage 0, in parentheses")
    print("| DP | stage | params | grads | optimizer | total (Megatron) |")
    print("|---|---|---|---|---|---|")
    for n in sorted({1, a.dp}):
        res = run_ranks(measure, n, a.layers, a.hidden, a.bucket, "bf16", timeout=600)[0]
        for stage, r in res.items():
            total = (r["params"] + r["grads"] + r["optim"]) / psi
            megatron = {0: " (18.00)", 1: f" ({2 + 4 + 12 / n:.2f})"}.get(stage, "")
            print(f"| {n} | {stage} | {r['params'] / psi:.2f} | {r['grads'] / psi:.2f} | {r['optim'] / psi:.2f} | "
                  f"{total:.2f}{megatron} |")


if __name__ == "__main__":
    main()
