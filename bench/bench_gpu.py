"""Training throughput and MFU on one GPU: megatron_zero's step against a plain PyTorch loop, same run.

    python bench/bench_gpu.py [--sizes 350M,1.3B,llama3-8b] [--seq 2048] [--micro-batch 4] [--steps 10]
                              [--warmup 3] [--peak-tflops N] [--device cuda] [--tiny] [--no-offload]
                              [--llama-layers N] [--llama-micro-batch 1] [--json PATH] [--fp8 RECIPE]

The model is megatron_zero's GPTModel (dropout 0):
  350M: 24 layers, hidden 1024, 16 heads;   1.3B: 24 layers, hidden 2048, 16 heads (GPT-2 layout,
  vocab 50304); llama3-8b: Llama-3-8B's shape (hidden 4096, 32 heads, 8 KV groups, SwiGLU FFN 14336,
  RMSNorm, RoPE, vocab 128256, untied, no biases) cut to the layers that fit one GPU's memory
  (--llama-layers, default: what the free memory holds at 20 bytes a parameter plus activations;
  32 is the whole model), micro-batch --llama-micro-batch; no offload rows (its host step would
  dominate). seq 2048.
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
  fp8:      ours with the blocks' linear layers in FP8 (--fp8 tensorwise|rowwise: torchao's float8, hybrid
            format, as --fp8-format hybrid --fp8-recipe RECIPE; emulated where the device has no FP8
            tensor cores): fp8 / ours is FP8's gain over bf16.
Same random tokens, same AdamW hyper-parameters. tokens/s = micro-batch * seq / median step time;
MFU = model FLOPs per step (megatron_zero.throughput, Megatron's count) / step time / the device's
peak dense bf16 FLOP/s (a table of known GPUs, or --peak-tflops). The two sides alternate step
blocks so they share the device's clocks. Each row also gives the side's peak allocated device memory
(torch.cuda.max_memory_allocated); a side that runs out of memory is a row saying so. --json PATH
writes the rows for scripts/gpu_check.sh. `--tiny --device cpu` runs a 2-layer model on the CPU
(checks the script; its numbers mean nothing).
"""
import argparse
import json
import statistics
import time

import torch

from megatron_zero.device import select_device, synchronize
from megatron_zero.model.config import GPTConfig
from megatron_zero.model.gpt import GPTModel
from megatron_zero.ops import set_fusion_flags
from megatron_zero.throughput import gpt_flops_per_iteration
from megatron_zero.zero import ZeroOptimizer

SIZES = {"350M": (24, 1024, 16), "1.3B": (24, 2048, 16), "tiny": (2, 128, 4), "llama3-8b": (32, 4096, 32)}
LLAMA3_8B = dict(vocab_size=128256, ffn_hidden_size=14336, num_query_groups=8, normalization="RMSNorm",
                 position_embedding_type="rope", rotary_base=500000, swiglu=True,
                 untie_embeddings_and_output_weights=True, add_bias_linear=False)
BYTES_PER_PARAM = 20  # bf16 weight + bf16 grad + fp32 main grad + fp32 master + two fp32 moments
PEAK_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0, "L40S": 362.0, "A10": 125.0, "V100": 125.0}


def peak_tflops(device, override):
    if override:
        return override
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_BF16_TFLOPS.items() if k in name), None)


LAYERS = {}  # size -> layers to build, where not SIZES' (llama3-8b cut to what fits)


def config(size, seq, dtype):
    layers, hidden, heads = SIZES[size]
    shape = dict(LLAMA3_8B) if size == "llama3-8b" else dict(vocab_size=50304)
    return GPTConfig(hidden_size=hidden, num_layers=LAYERS.get(size, layers), num_attention_heads=heads,
                     seq_length=seq, max_position_embeddings=seq, hidden_dropout=0.0, attention_dropout=0.0,
                     params_dtype=dtype, **shape)


def layers_that_fit(seq, micro_batch, device):
    """Llama-3-8B layers one GPU holds: free memory (less a 15% margin) after the untied embedding and output
    layer and the fp32 logits (three copies), over a layer's state and activations (flash attention)."""
    layers, hidden, _ = SIZES["llama3-8b"]
    if device.type != "cuda":
        return 1
    free = torch.cuda.mem_get_info(device)[0] * 0.85
    ffn, vocab, kv = LLAMA3_8B["ffn_hidden_size"], LLAMA3_8B["vocab_size"], hidden // 4
    per_layer = BYTES_PER_PARAM * (hidden * (hidden + 2 * kv) + hidden * hidden + 3 * hidden * ffn)
    per_layer += micro_batch * seq * (34 * hidden + 6 * ffn)  # bf16 activations kept for backward
    fixed = BYTES_PER_PARAM * 2 * vocab * hidden + 3 * 4 * micro_batch * seq * vocab + (2 << 30)
    return max(1, min(layers, int((free - fixed) // per_layer)))


def build(size, seq, device, dtype):
    cfg = config(size, seq, dtype)
    with device:
        return GPTModel(cfg), cfg


def ours_step(size, seq, device, offload="none", step_plus_copy=True, fp8=None):
    model, cfg = build(size, seq, device, torch.bfloat16)
    if fp8:
        from megatron_zero.fp8.convert import Float8Converter
        from megatron_zero.fp8.settings import Float8Settings, has_fp8_tensor_cores

        Float8Converter(Float8Settings("hybrid", fp8, emulate=not has_fp8_tensor_cores(device)), device)(model)
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


def build_parser():
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
    ap.add_argument("--llama-layers", type=int, default=None,
                    help="llama3-8b: layers to build (default: as many as the free memory holds)")
    ap.add_argument("--llama-micro-batch", type=int, default=1)
    ap.add_argument("--json", default=None, help="also write the rows to this JSON file")
    ap.add_argument("--fp8", default=None, choices=["tensorwise", "rowwise"],
                    help="add an fp8 row: ours with torchao's float8 GEMMs at this recipe (needs torchao)")
    return ap


def main():
    ap = build_parser()
    a = ap.parse_args()
    unknown = [s for s in a.sizes.split(",") if s not in SIZES]
    if unknown:
        ap.error(f"--sizes {a.sizes}: {', '.join(unknown)} is not one of {', '.join(SIZES)}")
    if a.llama_layers is not None and not 1 <= a.llama_layers <= SIZES["llama3-8b"][0]:
        ap.error(f"--llama-layers {a.llama_layers} must lie between 1 and {SIZES['llama3-8b'][0]}")
    device = select_device(a.device)
    sizes, seq = (["tiny"], 128) if a.tiny else (a.sizes.split(","), a.seq)
    peak = peak_tflops(device, a.peak_tflops)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"device: {name}; seq {seq}, micro-batch {a.micro_batch}, bf16; peak bf16 "
          f"{peak if peak else 'unknown'} TFLOP/s; {a.steps} timed steps after {a.warmup} warm-up")
    if "llama3-8b" in sizes:
        LAYERS["llama3-8b"] = a.llama_layers or layers_that_fit(seq, a.llama_micro_batch, device)
        print(f"llama3-8b: {LAYERS['llama3-8b']} of 32 layers, micro-batch {a.llama_micro_batch}")
    print(f"{'model':>9} | {'side':>8} | {'params':>7} | {'tokens/s':>9} | {'TFLOP/s':>8} | {'MFU':>6} | "
          f"{'peak GiB':>8} | vs baseline")
    rows = []
    for size in sizes:
        rows += bench_size(size, seq, a.llama_micro_batch if size == "llama3-8b" else a.micro_batch, a, device, peak)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"device": name, "seq": seq, "peak_tflops": peak, "rows": rows}, f, indent=1)


def bench_size(size, seq, micro_batch, a, device, peak):
    """Every side of one model size, timed and printed; -> the rows (dicts) for --json."""
    gen = torch.Generator().manual_seed(0)
    sides = [("baseline", baseline_step), ("ours", ours_step)]
    if a.fp8:
        sides.append(("fp8", lambda *x: ours_step(*x, fp8=a.fp8)))
    if not a.no_offload and size != "llama3-8b":
        sides += [("offload", lambda *x: ours_step(*x, offload="cpu")),
                  ("offl-old", lambda *x: ours_step(*x, offload="cpu", step_plus_copy=False))]
    results, cfg = {}, config(size, seq, torch.bfloat16)
    for side, make in sides:
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        try:
            step, cfg = make(size, seq, device)
            text = torch.randint(0, cfg.vocab_size, (micro_batch, seq + 1), generator=gen).to(device)
            tokens, labels = text[:, :-1].contiguous(), text[:, 1:].contiguous()
            timed(step, tokens, labels, a.warmup, device)
            t = statistics.median(timed(step, tokens, labels, a.steps, device))
            mem = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
            results[side] = (t, mem)
            del step, text, tokens, labels
        except torch.cuda.OutOfMemoryError as e:
            results[side] = f"out of memory ({str(e).splitlines()[0][:120]})"
    base = results.get("baseline")
    n, rows = _params(cfg), []
    flops = gpt_flops_per_iteration(micro_batch, seq, cfg.num_layers, cfg.hidden_size, cfg.padded_vocab_size(),
                                    cfg.ffn_hidden_size, cfg.qkv_size, cfg.swiglu)
    for side, res in results.items():
        row = {"model": size, "side": side, "layers": cfg.num_layers, "params": n, "micro_batch": micro_batch}
        if isinstance(res, str):
            print(f"{size:>9} | {side:>8} | {n / 1e6:6.0f}M | {res}")
            rows.append({**row, "error": res})
            continue
        t, mem = res
        tflops = flops / t / 1e12
        mfu = 100 * tflops / peak if peak else None
        vs = f"{base[0] / t:.2f}x" if isinstance(base, tuple) else "n/a"
        print(f"{size:>9} | {side:>8} | {n / 1e6:6.0f}M | {micro_batch * seq / t:9.0f} | {tflops:8.2f} | "
              f"{f'{mfu:5.1f}%' if mfu is not None else '  n/a'} | {f'{mem:8.1f}' if mem is not None else '     n/a'} | "
              f"{vs}")
        rows.append({**row, "step_s": t, "tokens_per_s": micro_batch * seq / t, "tflops": tflops, "mfu_percent": mfu,
                     "peak_gib": mem})
    return rows


def _params(cfg):
    """Parameters of GPTModel(cfg), counted from the shapes (building a big model just to count is slow)."""
    h, f, q, V, L = cfg.hidden_size, cfg.ffn_hidden_size, cfg.qkv_size, cfg.padded_vocab_size(), cfg.num_layers
    norm = 2 * h if cfg.normalization == "LayerNorm" else h
    up = 2 * f if cfg.swiglu else f
    layer = h * q + h * h + h * up + f * h + 2 * norm + (q + h + up + h if cfg.add_bias_linear else 0)
    position = cfg.max_position_embeddings * h if cfg.position_embedding_type == "learned_absolute" else 0
    return L * layer + V * h + position + (V * h if cfg.untie_embeddings_and_output_weights else 0) + norm


if __name__ == "__main__":
    main()
