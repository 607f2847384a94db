"""Training throughput and MFU on one GPU: megatron_zero's step against a plain PyTorch loop, same run.

    python bench/bench_gpu.py [--sizes 1.3B,llama3-8b] [--seq 2048] [--llama-seq 8192] [--micro-batch 4]
                              [--llama-micro-batch 1] [--micro-batches 8] [--steps 6] [--warmup 2] [--block 2]
                              [--peak-tflops N] [--device cuda] [--tiny] [--no-offload] [--no-pretrain]
                              [--llama-layers N] [--json PATH] [--fp8 tensorwise|rowwise] [--compile]

The model is megatron_zero's GPTModel (dropout 0):
  350M: 24 layers, hidden 1024, 16 heads;   1.3B: 24 layers, hidden 2048, 16 heads (GPT-2 layout,
  vocab 50304; seq --seq, micro-batch --micro-batch); llama3-8b: Llama-3-8B's shape (hidden 4096,
  32 heads, 8 KV groups, SwiGLU FFN 14336, RMSNorm, RoPE base 500000, the real vocabulary 128256,
  untied, no biases) at seq --llama-seq (8192) and micro-batch --llama-micro-batch (1), cut to the
  layers that fit one GPU's memory (--llama-layers, default: what the free memory holds at 20 bytes
  a parameter plus activations and the logits; 32 is the whole model); no offload rows there (its
  host step would dominate).
One step is what training runs: --micro-batches (8) forward + backward passes, then one optimizer
step (its cost amortised as in training). The sides (`SIDES`, one factory each; add a row there):
  baseline: the same GPTModel in fp32 under torch.autocast(bf16), fusions off (the PyTorch ops),
            torch.optim.AdamW(fused=True), gradient clipping: the plain PyTorch mixed-precision loop;
  ours:     bf16 weights, the fused kernels on (LayerNorm, causal softmax, bias-GeLU), ZeRO-1 on one
            rank (fp32 masters, fp32 main-grad accumulation, the multi-tensor AdamW);
  offload:  ours with --cpu-optimizer (ZeRO-Offload: fp32 masters and moments in pinned host memory,
            the C++ CPU Adam, gradients down and new bf16 weights up on a copy stream, each chunk's
            upload overlapping the CPU's step of the next: zero/offload.py's step + copy);
  offl-old: the same, the weights going up only after the whole CPU step (in write_weights, as
            before step + copy): offload / offl-old is what the overlap gains;
  fp8:      ours with the blocks' linear layers in FP8 (--fp8 RECIPE: torchao's float8, hybrid format,
            as --fp8-format hybrid --fp8-recipe RECIPE; emulated where the device has no FP8 tensor
            cores): fp8 / ours is FP8's gain over bf16 (docs/fp8.md);
  compiled: ours with each transformer layer compiled (--compile: pretrain_gpt.py --compile-layers,
            torch.compile's inductor; the fused kernels run eagerly between the compiled pieces; the
            compile happens in the --warmup steps): compiled / ours is compile's gain;
  pretrain_gpt.py: the same shape through the product's own path, `pretrain_gpt.py --mock-data
            --tokenizer-type NullTokenizer --vocab-size V-1` (the NullTokenizer adds the end-of-document
            id: V tokens), bf16, ZeRO-1, global batch = micro-batch x --micro-batches, in a process of
            its own; its step time is the median of the per-iteration times it logs after --warmup.
Same random tokens, same AdamW hyper-parameters. tokens/s = tokens of a step / median step time;
MFU = model FLOPs per step (megatron_zero.metrics.throughput, Megatron's count) / step time / the device's
peak dense bf16 FLOP/s (a table of known GPUs, or --peak-tflops). The in-process sides alternate
blocks of --block timed steps (the order reversed every round) so they share the device's clocks
and temperature; where their states do not fit the device together, they run one after the other
(the header and each row's `schedule` say which). Each row gives its side's peak allocated device
memory (torch.cuda.max_memory_allocated during its own steps, less what the other sides hold
resident); a side that runs out of memory is a row saying so. --json PATH writes the rows for
scripts/gpu_check.sh. `--tiny --device cpu` runs a 2-layer model on the CPU (checks the script;
its numbers mean nothing).
"""
import argparse
import gc
import json
import os
import re
import statistics
import subprocess
import sys
import time

import torch

from megatron_zero.distributed.device import select_device, synchronize
from megatron_zero.model.config import GPTConfig
from megatron_zero.model.gpt import GPTModel
from megatron_zero.ops import set_fusion_flags
from megatron_zero.metrics.throughput import gpt_flops_per_iteration
from megatron_zero.testing.multirank import free_port
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


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAYERS = {}  # size -> layers to build, where not SIZES' (llama3-8b cut to what fits)


def config(size, seq, dtype):
    layers, hidden, heads = SIZES[size]
    shape = dict(LLAMA3_8B) if size == "llama3-8b" else dict(vocab_size=512 if size == "tiny" else 50304)
    return GPTConfig(hidden_size=hidden, num_layers=LAYERS.get(size, layers), num_attention_heads=heads,
                     seq_length=seq, max_position_embeddings=seq, hidden_dropout=0.0, attention_dropout=0.0,
                     params_dtype=dtype, **shape)


def shape_of(size, a):
    """(seq, micro-batch) of a size's rows."""
    if a.tiny:
        return 64, 2
    return (a.llama_seq, a.llama_micro_batch) if size == "llama3-8b" else (a.seq, a.micro_batch)


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


def ours_step(size, seq, device, offload="none", step_plus_copy=True, fp8=None, compile_layers=False):
    model, cfg = build(size, seq, device, torch.bfloat16)
    if fp8:  # the model converter pretrain_gpt.py --fp8-format hybrid --fp8-recipe fp8 applies
        from megatron_zero.fp8.convert import Float8Converter
        from megatron_zero.fp8.settings import Float8Settings, has_fp8_tensor_cores

        Float8Converter(Float8Settings("hybrid", fp8, emulate=not has_fp8_tensor_cores(device)), device)(model)
    if compile_layers:  # after FP8, as the model converters order them (pretrain_gpt.py --compile-layers)
        from megatron_zero.compile.layers import CompileLayersConverter

        CompileLayersConverter(device)(model)
    opt = ZeroOptimizer(list(model.named_parameters()), stage=1, dtype="bf16", lr=1e-4, weight_decay=0.01,
                        clip_grad=1.0, device=device, offload=offload)
    if not step_plus_copy:  # write_weights brings the fp32 masters up after the whole CPU step
        opt.optimizer.weight_slices = None

    def step(batches):
        set_fusion_flags(masked_softmax_fusion=True, bias_gelu_fusion=True, persist_layer_norm=True)
        for tokens, labels in batches:  # fp32 main grads accumulate over the micro-batches
            opt.backward(model(tokens, labels=labels) / len(batches))
        opt.step()
    return step, cfg


def baseline_step(size, seq, device):
    model, cfg = build(size, seq, device, torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01, fused=device.type == "cuda")

    def step(batches):
        set_fusion_flags(masked_softmax_fusion=False, bias_gelu_fusion=False, persist_layer_norm=False)
        for tokens, labels in batches:
            with torch.autocast(device.type, dtype=torch.bfloat16):
                loss = model(tokens, labels=labels) / len(batches)
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step, cfg


# the in-process sides, in the order they are built and timed: (name, factory(size, seq, device) -> (step, cfg),
# whether the size takes it); a new row (another precision, compile) is one more entry
SIDES = [("baseline", baseline_step, lambda size, a: True),
         ("ours", ours_step, lambda size, a: True),
         ("offload", lambda *x: ours_step(*x, offload="cpu"), lambda size, a: not a.no_offload and size != "llama3-8b"),
         ("offl-old", lambda *x: ours_step(*x, offload="cpu", step_plus_copy=False),
          lambda size, a: not a.no_offload and size != "llama3-8b"),
         ("fp8", lambda *x: ours_step(*x, fp8=FP8_RECIPE[0]), lambda size, a: a.fp8 is not None),
         ("compiled", lambda *x: ours_step(*x, compile_layers=True), lambda size, a: a.compile)]
FP8_RECIPE = [None]  # --fp8, for the fp8 side


def timed(step, batches, n, device):
    times = []
    for _ in range(n):
        synchronize(device)
        t0 = time.perf_counter()
        step(batches)
        synchronize(device)
        times.append(time.perf_counter() - t0)
    return times


def _allocated(device):
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else 0


def _release(device):
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


class Side:
    """One in-process side: its step, the bytes it holds between steps, its step times and peak."""

    def __init__(self, name, make, size, seq, device, batches, warmup):
        before = _allocated(device)
        self.name, self.times, self.peak = name, [], 0
        self.step, self.cfg = make(size, seq, device)
        timed(self.step, batches, warmup, device)
        self.resident = _allocated(device) - before

    def block(self, batches, n, device, others_resident):
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        self.times += timed(self.step, batches, n, device)
        if device.type == "cuda":
            self.peak = max(self.peak, torch.cuda.max_memory_allocated(device) - others_resident)


def _oom(e):
    return f"out of memory ({str(e).splitlines()[0][:120]})"


def run_interleaved(sides, size, seq, device, batches, a):
    """Build every side, then alternate blocks of --block timed steps (order reversed every round).
    -> {name: Side or error}, or None where the sides do not fit the device together."""
    built, fits = [], True
    try:
        for name, make in sides:
            built.append(Side(name, make, size, seq, device, batches, a.warmup))
        rounds = -(-a.steps // a.block)
        for r in range(rounds):
            n = min(a.block, a.steps - r * a.block)
            for side in (built if r % 2 == 0 else built[::-1]):
                others = sum(o.resident for o in built if o is not side)
                side.block(batches, n, device, others)
    except torch.cuda.OutOfMemoryError:
        fits = False
    if not fits:  # outside the handler, so its traceback no longer holds the models
        built.clear()
        _release(device)
        return None
    return {s.name: s for s in built}


def run_sequential(sides, size, seq, device, batches, a):
    """Each side alone: build, warm up, time all steps, free. -> {name: Side or error}."""
    out = {}
    for name, make in sides:
        _release(device)
        try:
            side = Side(name, make, size, seq, device, batches, a.warmup)
            side.block(batches, a.steps, device, 0)
            side.step = None  # the model and optimizer go with the step's closure
            out[name] = side
        except torch.cuda.OutOfMemoryError as e:
            out[name] = _oom(e)
        _release(device)
    return out


# runs pretrain_gpt.py as `python pretrain_gpt.py FLAGS` does, then prints the allocator's peak
PRETRAIN_WRAPPER = ("import runpy, sys, torch\nsys.argv = sys.argv[1:]\ntry:\n    runpy.run_path(sys.argv[0], "
                    "run_name='__main__')\nfinally:\n    print('bench_gpu: peak allocated bytes', "
                    "torch.cuda.max_memory_allocated() if torch.cuda.is_available() else -1, flush=True)\n")


def pretrain_flags(cfg, micro_batch, micro_batches, iters, device):
    """pretrain_gpt.py's flags for GPTModel(cfg) on mock data, bf16, ZeRO-1, one rank."""
    flags = ["--num-layers", cfg.num_layers, "--hidden-size", cfg.hidden_size, "--num-attention-heads",
             cfg.num_attention_heads, "--ffn-hidden-size", cfg.ffn_hidden_size, "--seq-length", cfg.seq_length,
             "--max-position-embeddings", cfg.max_position_embeddings, "--micro-batch-size", micro_batch,
             "--global-batch-size", micro_batch * micro_batches, "--train-iters", iters, "--log-interval", 1,
             "--eval-iters", 0, "--eval-interval", iters + 1, "--lr", 1e-4, "--lr-decay-style", "constant",
             "--weight-decay", 0.01, "--clip-grad", 1.0, "--hidden-dropout", 0.0, "--attention-dropout", 0.0,
             "--bf16", "--zero-stage", 1, "--mock-data", "--tokenizer-type", "NullTokenizer",
             "--vocab-size", cfg.vocab_size - 1, "--device", device.type, "--seed", 1234]
    if cfg.normalization == "RMSNorm":
        flags += ["--normalization", "RMSNorm"]
    if cfg.position_embedding_type == "rope":
        flags += ["--position-embedding-type", "rope", "--rotary-base", cfg.rotary_base]
    if cfg.swiglu:
        flags += ["--swiglu"]
    if cfg.num_query_groups and cfg.num_query_groups != cfg.num_attention_heads:
        flags += ["--group-query-attention", "--num-query-groups", cfg.num_query_groups]
    if not cfg.add_bias_linear:
        flags += ["--disable-bias-linear"]
    if cfg.untie_embeddings_and_output_weights:
        flags += ["--untie-embeddings-and-output-weights"]
    return [str(f) for f in flags]


def run_pretrain(cfg, micro_batch, micro_batches, a, device):
    """pretrain_gpt.py in a process of its own -> (median step seconds after the warm-up, peak bytes or None),
    or the error's last line."""
    flags = pretrain_flags(cfg, micro_batch, micro_batches, a.warmup + a.steps, device)
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    run = subprocess.run([sys.executable, "-c", PRETRAIN_WRAPPER, os.path.join(ROOT, "pretrain_gpt.py"), *flags],
                         capture_output=True, text=True, env=env, cwd=ROOT)
    ms = [float(m.group(1)) for m in re.finditer(r"elapsed time per iteration \(ms\): ([0-9.]+)", run.stdout)]
    peak = re.search(r"bench_gpu: peak allocated bytes (-?\d+)", run.stdout)
    if run.returncode != 0 or len(ms) < a.warmup + a.steps:
        tail = (run.stderr.strip() or run.stdout.strip() or "no output").splitlines()[-1]
        return f"pretrain_gpt.py failed (exit {run.returncode}): {tail[:160]}"
    peak = int(peak.group(1)) if peak and int(peak.group(1)) >= 0 else None
    return statistics.median(ms[a.warmup:]) / 1000, peak


def build_parser():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1.3B,llama3-8b", help=f"comma-separated, of {', '.join(SIZES)}")
    ap.add_argument("--seq", type=int, default=2048, help="sequence length of the GPT sizes")
    ap.add_argument("--micro-batch", type=int, default=4, help="micro-batch of the GPT sizes")
    ap.add_argument("--llama-seq", type=int, default=8192, help="llama3-8b: sequence length")
    ap.add_argument("--llama-micro-batch", type=int, default=1, help="llama3-8b: micro-batch")
    ap.add_argument("--micro-batches", type=int, default=8, help="forward-backward passes per optimizer step")
    ap.add_argument("--steps", type=int, default=6, help="timed steps per side")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps per side first (at least 1)")
    ap.add_argument("--block", type=int, default=2, help="timed steps per side before the next side's turn")
    ap.add_argument("--peak-tflops", type=float, default=None, help="the device's peak dense bf16 TFLOP/s")
    ap.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    ap.add_argument("--tiny", action="store_true", help="a 2-layer model, vocab 512, seq 64 (script check)")
    ap.add_argument("--no-offload", action="store_true", help="leave out the --cpu-optimizer rows")
    ap.add_argument("--no-pretrain", action="store_true", help="leave out the pretrain_gpt.py rows")
    ap.add_argument("--llama-layers", type=int, default=None,
                    help="llama3-8b: layers to build (default: as many as the free memory holds)")
    ap.add_argument("--json", default=None, help="also write the rows to this JSON file")
    ap.add_argument("--fp8", default=None, choices=["tensorwise", "rowwise"],
                    help="add an fp8 row: ours with torchao's float8 GEMMs at this recipe (needs torchao)")
    ap.add_argument("--compile", action="store_true",
                    help="add a compiled row: ours with each transformer layer compiled (--compile-layers)")
    return ap


def main(argv=None):
    ap = build_parser()
    a = ap.parse_args(argv)
    FP8_RECIPE[0] = a.fp8
    unknown = [s for s in a.sizes.split(",") if s not in SIZES]
    if unknown:
        ap.error(f"--sizes {a.sizes}: {', '.join(unknown)} is not one of {', '.join(SIZES)}")
    if a.llama_layers is not None and not 1 <= a.llama_layers <= SIZES["llama3-8b"][0]:
        ap.error(f"--llama-layers {a.llama_layers} must lie between 1 and {SIZES['llama3-8b'][0]}")
    for flag in ("steps", "block", "micro_batches", "seq", "llama_seq", "micro_batch", "llama_micro_batch"):
        if getattr(a, flag) < 1:
            ap.error(f"--{flag.replace('_', '-')} {getattr(a, flag)} must be at least 1")
    if a.warmup < 1:
        ap.error(f"--warmup {a.warmup} must be at least 1: a side's first step allocates its optimizer state, and "
                 "what a side holds between steps is measured after it")
    device = select_device(a.device)
    sizes = ["tiny"] if a.tiny else a.sizes.split(",")
    peak = peak_tflops(device, a.peak_tflops)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"device: {name}; bf16, {a.micro_batches} micro-batches a step; peak bf16 "
          f"{peak if peak else 'unknown'} TFLOP/s; {a.steps} timed steps per side after {a.warmup} warm-up")
    if "llama3-8b" in sizes:
        LAYERS["llama3-8b"] = a.llama_layers or layers_that_fit(a.llama_seq, a.llama_micro_batch, device)
        print(f"llama3-8b: {LAYERS['llama3-8b']} of 32 layers, seq {a.llama_seq}, micro-batch {a.llama_micro_batch}")
    print(f"{'model':>9} | {'side':>15} | {'params':>7} | {'seq x mb':>9} | {'tokens/s':>9} | {'TFLOP/s':>8} | "
          f"{'MFU':>6} | {'peak GiB':>8} | {'schedule':>11} | vs baseline")
    rows = []
    for size in sizes:
        rows += bench_size(size, a, device, peak)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"device": name, "micro_batches": a.micro_batches, "peak_tflops": peak, "rows": rows}, f,
                      indent=1)
    return rows


def bench_size(size, a, device, peak):
    """Every side of one model size, timed and printed; -> the rows (dicts) for --json."""
    seq, micro_batch = shape_of(size, a)
    cfg = config(size, seq, torch.bfloat16)
    gen = torch.Generator().manual_seed(0)
    text = torch.randint(0, cfg.vocab_size, (a.micro_batches, micro_batch, seq + 1), generator=gen)
    batches = [(t[:, :-1].contiguous().to(device), t[:, 1:].contiguous().to(device)) for t in text]
    results = {}
    if not a.no_pretrain:  # first, while this process holds no model
        _release(device)
        results["pretrain_gpt.py"] = (run_pretrain(cfg, micro_batch, a.micro_batches, a, device), "own process")
    sides = [(n, make) for n, make, takes in SIDES if takes(size, a)]
    schedule, out = "interleaved", run_interleaved(sides, size, seq, device, batches, a)
    if out is None:
        schedule, out = "sequential", run_sequential(sides, size, seq, device, batches, a)
    for n, side in out.items():
        results[n] = ((statistics.median(side.times), side.peak if device.type == "cuda" else None)
                      if isinstance(side, Side) else side, schedule)
    del out
    _release(device)
    return _rows(size, cfg, seq, micro_batch, a.micro_batches, results, peak)


def _rows(size, cfg, seq, micro_batch, micro_batches, results, peak):
    base = results.get("baseline", (None,))[0]
    n, rows, tokens = _params(cfg), [], micro_batch * micro_batches * seq
    flops = gpt_flops_per_iteration(micro_batch * micro_batches, seq, cfg.num_layers, cfg.hidden_size,
                                    cfg.padded_vocab_size(), cfg.ffn_hidden_size, cfg.qkv_size, cfg.swiglu)
    for side, (res, schedule) in results.items():
        row = {"model": size, "side": side, "layers": cfg.num_layers, "params": n, "seq": seq,
               "micro_batch": micro_batch, "micro_batches": micro_batches, "schedule": schedule}
        if isinstance(res, str):
            print(f"{size:>9} | {side:>15} | {n / 1e6:6.0f}M | {res}")
            rows.append({**row, "error": res})
            continue
        t, mem = res
        mem = mem / 2**30 if mem is not None else None
        tflops = flops / t / 1e12
        mfu = 100 * tflops / peak if peak else None
        vs = f"{base[0] / t:.2f}x" if isinstance(base, tuple) else "n/a"
        print(f"{size:>9} | {side:>15} | {n / 1e6:6.0f}M | {f'{seq}x{micro_batch}':>9} | {tokens / t:9.0f} | "
              f"{tflops:8.2f} | {f'{mfu:5.1f}%' if mfu is not None else '  n/a'} | "
              f"{f'{mem:8.1f}' if mem is not None else '     n/a'} | {schedule:>11} | {vs}")
        rows.append({**row, "step_s": t, "tokens_per_s": tokens / t, "tflops": tflops, "mfu_percent": mfu,
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
