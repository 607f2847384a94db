#!/usr/bin/env python
"""tools/preprocess_data.py throughput on the built-in corpus, --workers 1 and 2.

Baseline in the same run: the same JSONL tokenized by the same SentencePiece model and
written with Megatron-Core's IndexedDatasetBuilder in one process (Megatron's
preprocess loop, minus its pool), when megatron-core is installed; the ratio
column is ours / that baseline (or / our --workers 1 run without megatron-core).
The corpus is run as built (0.49 MB) and repeated 10x (steady state, start-up amortised).

    .venv/bin/python bench/bench_preprocess.py [--reps 3]
"""
import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from megatron_zero.data.corpus import TOKENIZER_TYPE, build_corpus  # noqa: E402


def ours(jsonl, model, workers, out):
    cmd = [sys.executable, os.path.join(ROOT, "tools", "preprocess_data.py"), "--input", jsonl, "--output-prefix",
           out, "--tokenizer-type", TOKENIZER_TYPE, "--tokenizer-model", model, "--append-eod",
           "--workers", str(workers), "--log-interval", "1000"]
    r = subprocess.run(cmd, capture_output=True, text=True, check=True)
    m = re.search(r"Done: (\d+) documents, ([\d.]+) MB in ([\d.]+) s", r.stderr)
    return int(m.group(1)), float(m.group(2)), float(m.group(3))


def megatron_core_baseline(jsonl, model, out):
    import numpy as np
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    from megatron_zero.data.tokenizers import build_tokenizer
    tok = build_tokenizer(TOKENIZER_TYPE, tokenizer_model=model)
    t0 = time.perf_counter()
    b = IndexedDatasetBuilder(out + ".bin", dtype=DType.optimal_dtype(tok.vocab_size))
    n = nbytes = 0
    with open(jsonl, "rb") as f:
        for raw in f:
            ids = tok.tokenize(json.loads(raw)["text"]) + [tok.eod]
            b.add_document(np.array(ids), [len(ids)])
            n, nbytes = n + 1, nbytes + len(raw)
    b.finalize(out + ".idx")
    return n, nbytes / 1e6, time.perf_counter() - t0


def cpu_model():
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        return re.search(r"Model name:\s*(.+)", out).group(1).strip()
    except Exception:
        return platform.processor() or "unknown"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="bench_preprocess_")
    corpus = build_corpus(os.path.join(tmp, "builtin"), log=None)
    big = os.path.join(tmp, "builtin_x10.jsonl")
    with open(corpus["jsonl"]) as f, open(big, "w") as g:
        g.write(f.read() * 10)
    warnings.filterwarnings("ignore")
    try:
        import megatron.core.datasets.indexed_dataset  # noqa: F401
        have_mc = True
    except ImportError:
        have_mc = False
    print(f"machine: {cpu_model()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
          f"megatron-core {'installed' if have_mc else 'not installed'}, load average {os.getloadavg()[0]:.1f}")
    print(f"# median of {args.reps} interleaved runs; ratio = baseline time / this time (higher is faster)")
    print(f"{'input':<14} {'run':<34} {'docs':>6} {'MB':>6} {'median s':>9} {'docs/s':>9} {'MB/s':>7} {'ratio':>6}")
    for name, jsonl in (("builtin", corpus["jsonl"]), ("builtin x10", big)):
        rows = []
        if have_mc:
            rows.append(("megatron-core builder, 1 proc", lambda: megatron_core_baseline(jsonl, corpus["tokenizer_model"], os.path.join(tmp, "mc"))))
        for w in (1, 2):
            rows.append((f"preprocess_data.py --workers {w}", lambda w=w: ours(jsonl, corpus["tokenizer_model"], w, os.path.join(tmp, f"o{w}"))))
        runs = {label: [] for label, _ in rows}
        for _ in range(args.reps):  # interleaved, so a burst of load hits every row alike
            for label, fn in rows:
                runs[label].append(fn())
        base = None
        for label, _ in rows:
            docs, mb = runs[label][0][0], runs[label][0][1]
            sec = statistics.median(r[2] for r in runs[label])
            base = base or sec
            print(f"{name:<14} {label:<34} {docs:>6} {mb:>6.2f} {sec:>9.3f} {docs / sec:>9.0f} {mb / sec:>7.2f} {base / sec:>6.2f}")


if __name__ == "__main__":
    main()
