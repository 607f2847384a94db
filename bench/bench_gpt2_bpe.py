#!/usr/bin/env python
"""GPT2BPETokenizer: the `tokenizers` library (ours now) against the hand-written byte-level BPE it replaced.

Baseline in the same run: megatron_zero/data/gpt2_bpe.py as of commit ce7fe42 (read from git history),
on the same vocab.json + merges.txt: a byte-level BPE of --vocab-size trained here with `tokenizers`
on the built-in pydoc corpus text (nothing downloaded). Both tokenize every document of the corpus
--reps times; the ids must be identical. Columns: load time (first use, including the hand-written
tokenizer's Unicode tables), tokenize throughput by wall clock and by this process's CPU time (the
machine is shared: CPU time is the steadier), ratio = ours / baseline in CPU time.

    .venv/bin/python bench/bench_gpt2_bpe.py [--vocab-size 8000] [--reps 3]
"""
import argparse
import importlib.util
import os
import platform
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from megatron_zero.data.hf_tokenizers import GPT2BPETokenizer  # noqa: E402

BASELINE_COMMIT = "ce7fe42"


def hand_written(tmp: str):
    source = subprocess.run(["git", "-C", ROOT, "show", f"{BASELINE_COMMIT}:megatron_zero/data/gpt2_bpe.py"],
                            capture_output=True, text=True, check=True).stdout
    path = os.path.join(tmp, "gpt2_bpe_baseline.py")
    with open(path, "w") as f:
        f.write(source.replace("from .errors import DataError", "DataError = ValueError"))
    spec = importlib.util.spec_from_file_location("gpt2_bpe_baseline", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.GPT2BPETokenizer


def run(make, texts, reps):
    t0 = time.perf_counter()
    tok = make()
    tok.tokenize("warm up")
    load = time.perf_counter() - t0
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(reps):
        ids = [tok.tokenize(t) for t in texts]
    return load, (time.perf_counter() - t0) / reps, (time.process_time() - c0) / reps, ids


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vocab-size", type=int, default=8000)
    p.add_argument("--reps", type=int, default=3)
    a = p.parse_args()
    import pydoc_data.topics
    from tokenizers import ByteLevelBPETokenizer

    texts = list(pydoc_data.topics.topics.values())
    mb = sum(len(t.encode("utf-8")) for t in texts) / 1e6
    with tempfile.TemporaryDirectory() as tmp:
        trainer = ByteLevelBPETokenizer()
        trainer.train_from_iterator(texts, vocab_size=a.vocab_size, special_tokens=["<|endoftext|>"],
                                    show_progress=False)
        trainer.save_model(tmp)
        vocab, merges = os.path.join(tmp, "vocab.json"), os.path.join(tmp, "merges.txt")
        base_cls = hand_written(tmp)
        base = run(lambda: base_cls(vocab, merges), texts, a.reps)
        ours = run(lambda: GPT2BPETokenizer(vocab, merges), texts, a.reps)
    assert ours[3] == base[3], "the two tokenizers disagree on the corpus"
    tokens = sum(len(i) for i in ours[3])
    print(f"# {platform.node()} {os.cpu_count()} cores, {time.strftime('%Y-%m-%d')}, corpus {mb:.2f} MB "
          f"({len(texts)} documents, {tokens} tokens, identical ids), vocab {a.vocab_size}, {a.reps} reps")
    print(f"{'tokenizer':<34}{'load s':>9}{'MB/s wall':>11}{'MB/s CPU':>10}{'ratio (CPU)':>13}")
    for name, (load, secs, cpu, _) in (("hand-written gpt2_bpe (baseline)", base), ("tokenizers (ours)", ours)):
        print(f"{name:<34}{load:>9.3f}{mb / secs:>11.2f}{mb / cpu:>10.2f}{base[2] / cpu:>12.2f}x")


if __name__ == "__main__":
    main()
