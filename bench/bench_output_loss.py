"""Peak memory of the output layer + cross-entropy at a large vocabulary: the whole logits then the
vocab-parallel cross-entropy (--no-cross-entropy-loss-fusion, the baseline, measured in the same run)
against the fused output layer + loss by vocabulary chunks (tensor_parallel/output_loss.py, the default).

    .venv/bin/python bench/bench_output_loss.py [--tokens 2048] [--vocab 128256] [--hidden 512]

TP 1, fp32, on the CPU; both sides in one fresh process (megatron_zero/testing/loss_memory.py says how
the peaks are read: resident-set high-water marks with every allocation above 64 KiB its own mapping; the
weight's gradient, made by both, is left out). Ratios are to the bytes of the fp32 logits [tokens, vocab].
"""
import argparse
import os
import platform
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from megatron_zero.testing.loss_memory import peaks_in_subprocess  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--hidden", type=int, default=512)
    a = ap.parse_args()
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}")
    print(f"{a.tokens} tokens, vocab {a.vocab}, hidden {a.hidden}, fp32, TP 1; MiB = 2**20 bytes")
    peaks = peaks_in_subprocess(a.tokens, a.vocab, a.hidden, timeout=3600)
    rows = [("whole logits + cross-entropy (baseline)", peaks["unfused"]), ("fused by vocabulary chunks", peaks["fused"])]
    mib = 2 ** 20
    print(f"fp32 logits: {rows[0][1]['logits'] / mib:.1f} MiB")
    print("| path | forward peak MiB | backward peak MiB | peak / logits bytes | loss | seconds |")
    print("|---|---|---|---|---|---|")
    for name, r in rows:
        print(f"| {name} | {r['forward'] / mib:.1f} | {r['backward'] / mib:.1f} | {r['peak'] / r['logits']:.3f} | "
              f"{r['loss']:.6f} | {r['seconds']:.1f} |")


if __name__ == "__main__":
    main()
