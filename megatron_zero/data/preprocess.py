"""JSONL -> `{prefix}_{key}_document.bin/.idx`, tokenized by a pool of worker processes.

The library half of tools/preprocess_data.py (the built-in corpus calls it too).
Lines are read as bytes in the parent, parsed and tokenized in workers, and written
in input order, so the output does not depend on the number of workers.
"""
from __future__ import annotations

import multiprocessing as mp
import sys
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

import numpy as np

from .errors import DataError
from .indexed_dataset import IndexedDatasetBuilder, optimal_dtype
from .jsonl import parse_line
from .tokenizers import build_tokenizer


@dataclass
class PreprocessStats:
    documents: int = 0
    bytes: int = 0
    seconds: float = 0.0
    skipped: List[str] = field(default_factory=list)
    outputs: List[str] = field(default_factory=list)

    @property
    def docs_per_s(self) -> float:
        return self.documents / max(self.seconds, 1e-9)

    @property
    def mb_per_s(self) -> float:
        return self.bytes / 1e6 / max(self.seconds, 1e-9)


_STATE: dict = {}


def _init_worker(tokenizer_kwargs: dict, keys: Sequence[str], append_eod: bool, path: str, dtype) -> None:
    _STATE.update(tokenizer=build_tokenizer(**tokenizer_kwargs), keys=list(keys),
                  append_eod=append_eod, path=path, dtype=dtype)


def _encode(item):
    lineno, raw = item
    try:
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise DataError(f"{_STATE['path']} line {lineno} is not valid UTF-8.") from None
        doc = parse_line(line, _STATE["keys"], _STATE["path"], lineno)
    except DataError as e:
        return lineno, None, str(e), len(raw)
    tok, out = _STATE["tokenizer"], {}
    for key, text in doc.items():
        ids = tok.tokenize(text)
        if ids and _STATE["append_eod"]:
            ids.append(tok.eod)
        out[key] = np.asarray(ids, dtype=_STATE["dtype"])
    return lineno, out, None, len(raw)


def _numbered_lines(path: str):
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            if raw.strip():
                yield lineno, raw


def preprocess(input_path: str, output_prefix: str, tokenizer_type: str, tokenizer_model: Optional[str] = None,
               vocab_file: Optional[str] = None, merge_file: Optional[str] = None, vocab_size: Optional[int] = None,
               json_keys: Sequence[str] = ("text",), append_eod: bool = False, workers: int = 1,
               skip_bad_lines: bool = False, log_interval: float = 1.0, log=sys.stderr,
               tokenizer_options: Optional[dict] = None) -> PreprocessStats:
    """Tokenize every document of `input_path`; returns counts and throughput.

    A bad line raises DataError naming the file and line, unless skip_bad_lines,
    in which case it is left out and listed in `stats.skipped`. Outputs appear
    only when complete (written under temporary names, renamed at the end).
    `tokenizer_options`: build_tokenizer's TikTokenizer settings (tiktoken_pattern, ...).
    """
    tk = dict(tokenizer_type=tokenizer_type, tokenizer_model=tokenizer_model, vocab_file=vocab_file,
              merge_file=merge_file, vocab_size=vocab_size, **(tokenizer_options or {}))
    dtype = optimal_dtype(build_tokenizer(**tk).vocab_size)
    init_args = (tk, json_keys, append_eod, input_path, dtype)
    prefixes = {k: f"{output_prefix}_{k}_document" for k in json_keys}
    stats = PreprocessStats(outputs=list(prefixes.values()))
    builders: Dict[str, IndexedDatasetBuilder] = {}
    start = last = time.perf_counter()
    pool = None
    try:
        builders = {k: IndexedDatasetBuilder(p, dtype) for k, p in prefixes.items()}
        if workers > 1:
            pool = mp.get_context("fork").Pool(workers, _init_worker, init_args)
            results = pool.imap(_encode, _numbered_lines(input_path), chunksize=32)
        else:
            _init_worker(*init_args)
            results = map(_encode, _numbered_lines(input_path))
        for lineno, doc, err, nbytes in results:
            stats.bytes += nbytes
            if err is not None:
                if not skip_bad_lines:
                    raise DataError(err)
                stats.skipped.append(err)
                continue
            for k, ids in doc.items():
                builders[k].add_document(ids, [ids.size] if ids.size else [])
            stats.documents += 1
            now = time.perf_counter()
            if log is not None and now - last >= log_interval:
                last = now
                _report(log, "Processed", stats, now - start)
        for b in builders.values():
            b.finalize()
    except BaseException:
        for b in builders.values():
            b.abort()
        raise
    finally:
        if pool is not None:
            pool.terminate()
    stats.seconds = time.perf_counter() - start
    if log is not None:
        _report(log, "Done:", stats, stats.seconds)
    return stats


def _report(log, what: str, stats: PreprocessStats, elapsed: float) -> None:
    skipped = f", {len(stats.skipped)} bad lines skipped" if stats.skipped else ""
    print(f"{what} {stats.documents} documents, {stats.bytes / 1e6:.2f} MB in {elapsed:.2f} s "
          f"({stats.documents / max(elapsed, 1e-9):.1f} docs/s, {stats.bytes / 1e6 / max(elapsed, 1e-9):.2f} MB/s)"
          f"{skipped}.", file=log, flush=True)
