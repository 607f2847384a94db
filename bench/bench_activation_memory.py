"""Activation memory of the transformer layers: no / selective / full recompute, the attention backends,
and sequence parallelism at TP2, measured in bytes.

    .venv/bin/python bench/bench_activation_memory.py [--seqs 2048 8192] [--layers 4] [--hidden 256] [--heads 8]

What is measured, and how. One pipeline stage holding only transformer layers (no embedding or
logits) runs forward and backward on one micro-batch [1, s, h] (hidden dropout 0.1, attention
dropout 0 so that every backend applies). Each configuration runs in a fresh process (gloo
ranks forked by run_ranks; TP2 rows measure rank 0, whose numbers equal rank 1's to within a
page). glibc is told to serve every allocation above 64 KiB by its own mmap (mallopt
M_MMAP_THRESHOLD, which also stops the threshold from drifting), so the resident set grows and
shrinks with the tensors; after a warm-up step of the same size (which also grows shm_comm's shared-memory
buffers of the TP collectives to what this step needs: resident pages too, which a smaller warm-up left to
grow inside the measurement and counted as activations) the kernel's high-water mark is reset
(/proc/self/clear_refs 5) and then
    held = resident bytes after forward - before (what the layers keep for backward, plus the output)
    peak = high-water mark during forward + backward - resident bytes before (all transients included:
           scores, recomputed activations, gradients of activations; the parameters' .grad exist
           from the warm-up and are not counted).
The baseline row of each group is `none` (no recompute) measured in the same run; the ratio is
to it. The bound for full recompute is "one layer's activations plus the layer inputs": one
layer's peak (the same model with 1 layer, measured) plus L x s x h x 4 bytes, the inputs of the
other L - 1 layers and the gradient arriving at the layer being recomputed (the 1-layer model's
output gradient exists before the measurement starts, so its peak leaves that one out).
"""
import argparse
import ctypes
import gc
import os
import platform
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from megatron_zero.model.config import GPTConfig  # noqa: E402
from megatron_zero.model.gpt import GPTModel  # noqa: E402
from megatron_zero.model.layer_indices import block_layer_index  # noqa: E402
from megatron_zero.tensor_parallel import model_parallel_seed  # noqa: E402
from megatron_zero.testing import run_ranks  # noqa: E402
from megatron_zero.testing.host_memory import reset_high_water_mark, status_bytes  # noqa: E402
from megatron_zero.distributed.topology import build_parallel_state  # noqa: E402

M_MMAP_THRESHOLD = -3
RECOMPUTE = {"none": {}, "selective": {"recompute_granularity": "selective"},
             "full": {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}}


def measure(seq, layers, hidden, heads, backend, recompute, tp, sp):
    ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, 64 * 1024)
    state = build_parallel_state(tp=tp)
    model_parallel_seed(1, state.tp_rank)
    config = GPTConfig(vocab_size=1024, hidden_size=hidden, num_layers=layers, num_attention_heads=heads,
                       seq_length=seq, max_position_embeddings=seq, hidden_dropout=0.1, attention_dropout=0.0,
                       attention_backend=backend, sequence_parallel=sp, **RECOMPUTE[recompute])
    model = GPTModel(config, state.tp_group if tp > 1 else None,
                     layer_indices=range(block_layer_index(0), block_layer_index(layers)))
    local = seq // tp if sp else seq
    for s in (local, local):  # warm-up, then the measured step
        x = torch.randn(1, s, hidden, requires_grad=True)
        grad = torch.randn(1, s, hidden)
        model.zero_grad(set_to_none=False)  # the warm-up allocated the parameter gradients: not counted
        gc.collect()
        before = status_bytes("VmRSS")
        reset_high_water_mark()
        y = model(x)
        held = status_bytes("VmRSS") - before
        y.backward(grad)
        peak = status_bytes("VmHWM") - before
        del y
    return held, peak, local * hidden * 4


def run(seq, layers, hidden, heads, backend, recompute, tp=1, sp=False):
    return run_ranks(measure, tp, seq, layers, hidden, heads, backend, recompute, tp, sp, timeout=1800)[0]


def mib(n):
    return f"{n / 2**20:9.1f}"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqs", type=int, nargs="+", default=[2048, 8192])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--unfused-max-seq", type=int, default=4096,
                    help="measure the unfused backend (its [b, heads, s, s] tensors) only up to this sequence")
    a = ap.parse_args()
    print(f"# {platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}; "
          f"{a.layers} layers, hidden {a.hidden}, {a.heads} heads, micro-batch 1, fp32, 1 thread per rank")
    print("| seq | backend | TP | SP | recompute | held MiB | peak MiB | held / none | peak / none | full bound MiB |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for seq in a.seqs:
        for backend, tp, sp in (("unfused", 1, False), ("flash", 1, False), ("flash", 2, False), ("flash", 2, True)):
            if backend == "unfused" and seq > a.unfused_max_seq:
                print(f"| {seq} | unfused | | | | not run: above --unfused-max-seq {a.unfused_max_seq} | | | | |")
                continue
            one_layer_peak = run(seq, 1, a.hidden, a.heads, backend, "none", tp, sp)[1]
            rows = ("none", "selective", "full") if tp == 1 else ("none", "full")
            base = None
            for recompute in rows:
                held, peak, input_bytes = run(seq, a.layers, a.hidden, a.heads, backend, recompute, tp, sp)
                base = base or (held, peak)
                bound = mib(one_layer_peak + a.layers * input_bytes) if recompute == "full" else ""
                print(f"| {seq} | {backend} | {tp} | {'on' if sp else 'off'} | {recompute} | {mib(held)} | "
                      f"{mib(peak)} | {held / base[0]:.2f} | {peak / base[1]:.2f} | {bound} |", flush=True)


if __name__ == "__main__":
    main()
