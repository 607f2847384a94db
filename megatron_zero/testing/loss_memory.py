"""Peak host memory of the output layer + cross-entropy, forward and backward, fused by vocabulary chunks
(tensor_parallel/output_loss.py) or not (the whole logits, then tensor_parallel/cross_entropy.py), at TP 1
in fp32, in a process of its own (its allocator is set up for the measurement):

    python -m megatron_zero.testing.loss_memory TOKENS VOCAB HIDDEN   # prints one JSON line
    peaks_in_subprocess(tokens, vocab, hidden)       # runs that -> {"fused": {...}, "unfused": {...}}

How: glibc serves every allocation above 64 KiB by its own mmap (mallopt M_MMAP_THRESHOLD), so the
resident set grows and shrinks with the tensors; after a warm-up at 64 tokens the kernel's high-water
mark is reset (/proc/self/clear_refs 5) before the forward and again before the backward:
    forward  = high-water mark during the forward - resident bytes before it
    backward = high-water mark during the backward - the same start - the weight's gradient
the weight's gradient (vocab x hidden x 4 bytes, what every path makes, once, and what memory per
parameter counts) is left out; the hidden states' gradient and everything transient count.
`logits` is tokens x vocab x 4, the bytes of the fp32 logits the fused path never holds; `seconds` the
forward and backward's wall time (for the bench; no test reads it).
"""
from __future__ import annotations

import ctypes
import gc
import json
import os
import subprocess
import sys
import time

from .host_memory import reset_high_water_mark, status_bytes

M_MMAP_THRESHOLD = -3


def measure(tokens: int, vocab: int, hidden: int, fused: bool) -> dict:
    """One path's forward, backward and overall peak bytes, the logits' bytes, the loss, the seconds."""
    import torch
    import torch.nn.functional as F

    from ..tensor_parallel import vocab_parallel_cross_entropy
    from ..tensor_parallel.output_loss import vocab_parallel_linear_cross_entropy

    gen = torch.Generator().manual_seed(0)
    weight = (torch.randn(vocab, hidden, generator=gen) * 0.02).requires_grad_()

    def losses(x, target):
        if fused:
            return vocab_parallel_linear_cross_entropy(x, weight, target, None, vocab, chunked=True)
        return vocab_parallel_cross_entropy(F.linear(x, weight), target, None, vocab)

    out = {}
    for n in (64, tokens):  # warm-up, then the measured step
        x = torch.randn(n, hidden, generator=gen).requires_grad_()
        target = torch.randint(0, vocab, (n,), generator=gen)
        weight.grad = None
        gc.collect()
        before = status_bytes("VmRSS")
        reset_high_water_mark()
        start = time.perf_counter()
        loss = losses(x, target).mean()
        forward = status_bytes("VmHWM") - before
        reset_high_water_mark()
        loss.backward()
        seconds = time.perf_counter() - start
        backward = status_bytes("VmHWM") - before - weight.grad.numel() * weight.grad.element_size()
        out = {"forward": forward, "backward": backward, "peak": max(forward, backward),
               "logits": n * vocab * 4, "loss": float(loss.detach()),
               "seconds": seconds}
        del loss
    return out


def peaks_in_subprocess(tokens: int, vocab: int, hidden: int, timeout: float = 600) -> dict:
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])),
               OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "2"))
    done = subprocess.run([sys.executable, "-m", "megatron_zero.testing.loss_memory", str(tokens), str(vocab),
                           str(hidden)], env=env, capture_output=True, text=True,
                          timeout=timeout, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, 64 * 1024)
    t, v, h = map(int, sys.argv[1:4])
    print(json.dumps({kind: measure(t, v, h, kind == "fused") for kind in ("unfused", "fused")}))
