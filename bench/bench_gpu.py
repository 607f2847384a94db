"""Training throughput and MFU on one GPU: megatron_zero's step against a plain PyTorch loop, same run.

    python bench/bench_gpu.py [--sizes 350M,1.3B] [--seq 2048] [--micro-batch 4] [--steps 10]
                              [--warmup 3] [--peak-tflops N] [--device cuda] [--tiny] [--no-offload]

The model is megatron_zero's GPTModel (GPT-2 layout, vocab 50304, dropout 0):
  350M: 24 layers, hidden 1024, 16 heads;   1.3B: 24 layers, hidden 2048, 16 heads;  seq 2048.
  ours:     bf16 weights, the fused kernels on (LayerNorm, causal softmax, bias-GeLU), ZeRO-1 on one
            rank (fp32 masters, fp32 main-grad accumulation, the multi-tensor AdamW), one step =
            forward + backward + ZeroOptimizer.step;
  offload:  ours with --cpu-optimizer (ZeRO-Offload: fp32 masters and moments in pinned host memory,
            the C++ CPU Adam, gradients down and new bf16 weights up on a copy stream, each chunk's
            upload overlapping the CPU's step of the next: zero/offload.py's step + copy);
  offl-old: the same, the weights going up only after the whole CPU step (in write_weights, as
            before step + copy): offload / offl-old is what the overlap gains;
  baseline: the same GPTModel in fp32 under torch.autocast(bf16), fusions off (the PyTorch ops),
            torch.optim.AdamW(fused=True): the plain PyTorch mixed-precision loop.
Same random tokens, same AdamW hyper-parameters. tokens/s = micro-batch * seq / median step time;
MFU = model FLOPs per step (megatron_zero.throughput, Megatron's count) / step time / the device's
peak dense bf16 FLOP/s (a table of known GPUs, or --peak-tflops). The two sides alternate step
blocks so they share the device's clocks. `--tiny --device cpu` runs a 2-layer model on the CPU
(checks the script; its numbers mean nothing).
"""
import argparse
import statistics
import time

import torch

from megatron_zero.device import select_device, synchronize
from megatron_zero.model.config import GPTConfig
from megatron_zero.model.gpt import GPTModel
from megatron_zero.ops import set_fusion_flags
from megatron_zero.throughput import gpt_flops_per_iteration
from megatron_zero.zero import ZeroOptimizer

SIZES = {"350M": (24, 1024, 16), "1.3B": (24, 2048, 16), "tiny": (2, 128, 4)}
PEAK_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0, "L40S": 362.0, "A10": 125.0, "V100": 125.0}


def peak_tflops(device, override):
    if override:
        return override
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_BF16_TFLOPS.items() if k in name), None)


def build(size, seq, device, dtype):
    layers, hidden, heads = SIZES[size]
    cfg = GPTConfig(vocab_size=50304, hidden_size=hidden, num_layers=layers, num_attention_heads=heads,
                    seq_length=seq, max_position_embeddings=seq, hidden_dropout=0.0, attention_dropout=0.0,
                    params_dtype=dtype)
    with device:
        return GPTModel(cfg), cfg


def ours_step(size, seq, device, offload="none", step_plus_copy=True):
    model, cfg = build(size, seq, device, torch.bfloat16)
    opt = ZeroOptimizer(list(model.named_parameters()), stage=1, dtype="bf16", lr=1e-4, weight_decay=0.01,
                        clip_grad=1.0, device=device, offload=offload)
    if not step_plus_copy:  # write_weights brings the fp32 masters up after the whole CPU step
        opt.optimizer.weight_slices = None

    def step(tokens, labels):
        set_fusion_flags(masked_softmax_fusion=True, bias_gelu_fusion=True, persist_layer_norm=True)
        opt.backward(model(tokens, labels=labels))
        opt.step()
    return step, cfg


def baseline_step(size, seq, device):
    model, cfg = build(size, seq, device, torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01, fused=device.type == "cuda")

    def step(tokens, labels):
        set_fusion_flags(masked_softmax_fusion=False, bias_gelu_fusion=False, persist_layer_norm=False)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = model(tokens, labels=labels)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step, cfg


def timed(step, tokens, labels, n, device):
    times = []
    for _ in range(n):
        synchronize(device)
        t0 = time.perf_counter()
        step(tokens, labels)
        synchronize(device)
        times.append(time.perf_counter() - t0)
    return times


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="350M,1.3B")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--peak-tflops", type=float, default=None)
    ap.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    ap.add_argument("--tiny", action="store_true", help="a 2-layer model, seq 128 (script check)")
    ap.add_argument("--no-offload", action="store_true", help="leave out the --cpu-optimizer rows")
    a = ap.parse_args()
    device = select_device(a.device)
    sizes, seq = (["tiny"], 128) if a.tiny else (a.sizes.split(","), a.seq)
    peak = peak_tflops(device, a.peak_tflops)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"device: {name}; seq {seq}, micro-batch {a.micro_batch}, bf16; peak bf16 "
          f"{peak if peak else 'unknown'} TFLOP/s; {a.steps} timed steps after {a.warmup} warm-up")
    print(f"{'model':>6} | {'side':>8} | {'params':>7} | {'tokens/s':>9} | {'TFLOP/s':>8} | {'MFU':>6} | vs baseline")
    gen = torch.Generator().manual_seed(0)
    for size in sizes:
        results = {}
        sides = [("baseline", baseline_step), ("ours", ours_step)]
        if not a.no_offload:
            sides += [("offload", lambda *x: ours_step(*x, offload="cpu")),
                      ("offl-old", lambda *x: ours_step(*x, offload="cpu", step_plus_copy=False))]
        for side, make in sides:
            step, cfg = make(size, seq, device)
            text = torch.randint(0, cfg.vocab_size, (a.micro_batch, seq + 1), generator=gen).to(device)
            tokens, labels = text[:, :-1].contiguous(), text[:, 1:].contiguous()
            timed(step, tokens, labels, a.warmup, device)
            results[side] = (statistics.median(timed(step, tokens, labels, a.steps, device)), cfg)
            del step
            if device.type == "cuda":
                torch.cuda.empty_cache()
        base = results["baseline"][0]
        for side, (t, cfg) in results.items():
            n = _params(cfg)
            flops = gpt_flops_per_iteration(a.micro_batch, seq, cfg.num_layers, cfg.hidden_size,
                                            cfg.padded_vocab_size(), cfg.ffn_hidden_size)
            tflops = flops / t / 1e12
            mfu = f"{100 * tflops / peak:5.1f}%" if peak else "  n/a"
            print(f"{size:>6} | {side:>8} | {n / 1e6:6.0f}M | {a.micro_batch * seq / t:9.0f} | {tflops:8.2f} | "
                  f"{mfu} | {base / t:.2f}x")


def _params(cfg):
    h, f, L, V = cfg.hidden_size, cfg.ffn_hidden_size, cfg.num_layers, cfg.padded_vocab_size()
    return L * (4 * h * h + 2 * h * f + 9 * h + f) + V * h + cfg.max_position_embeddings * h + 2 * h


if __name__ == "__main__":
    main()
