#!/usr/bin/env python
"""What the start-up token-id check (megatron_zero/data/token_range.py) costs.

For the built-in corpus and a synthetic 512 MiB uint16 .bin: the first run's scan of the
memory-mapped .bin (max over it, written to the index cache), a later run's cached look-up,
and, as the baseline in the same run, opening the dataset and building its GPT sample
indices (what every start-up already does for that .bin). The ratio is check / baseline.

    .venv/bin/python bench/bench_token_range.py [--reps 3]
"""
import argparse
import os
import platform
import statistics
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from megatron_zero.data import token_range  # noqa: E402
from megatron_zero.data.corpus import build_corpus  # noqa: E402
from megatron_zero.data.gpt_dataset import GPTDataset  # noqa: E402
from megatron_zero.data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder  # noqa: E402


def timed(fn, reps):
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def synthetic(prefix, tokens):
    b = IndexedDatasetBuilder(prefix, dtype=np.uint16)
    rng = np.random.default_rng(0)
    for chunk in np.array_split(rng.integers(0, 50000, size=tokens, dtype=np.uint16), tokens // 2048):
        b.add_document(chunk)
    b.finalize()
    return prefix


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--reps", type=int, default=3)
    a = p.parse_args()
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, python {platform.python_version()}, "
          f"load average {os.getloadavg()[0]:.1f}")
    print(f"{'dataset':<28}{'tokens':>12}{'scan ms':>10}{'cached ms':>11}{'baseline ms':>13}{'scan/base':>11}")
    with tempfile.TemporaryDirectory() as tmp:
        corpus = build_corpus(os.path.join(tmp, "corpus"))
        prefixes = [("built-in corpus", corpus["data_prefix"]),
                    ("synthetic 512 MiB", synthetic(os.path.join(tmp, "big"), 256 << 20))]
        for name, prefix in prefixes:
            ds = IndexedDataset(prefix)
            path = prefix + ".bin"
            scan = timed(lambda: token_range.scan_max_token_id(path, ds.dtype), a.reps)
            cache = os.path.join(tmp, "cache", name.replace(" ", "_"))
            token_range.max_token_id(ds, cache)
            cached = timed(lambda: token_range.max_token_id(ds, cache), a.reps)
            docs = np.arange(len(ds), dtype=np.int32)
            base = timed(lambda: GPTDataset(IndexedDataset(prefix), "train", docs, 1000, 256, 1,
                                            tempfile.mkdtemp(dir=tmp)), a.reps)
            tokens = os.path.getsize(path) // ds.dtype.itemsize
            print(f"{name:<28}{tokens:>12}{scan * 1e3:>10.2f}{cached * 1e3:>11.2f}{base * 1e3:>13.2f}"
                  f"{scan / base:>11.3f}")


if __name__ == "__main__":
    main()
