"""The largest token id of a dataset against the model's vocabulary, checked before training.

A `.bin` tokenized with another tokenizer holds ids the model has no row for: at TP 1
the embedding raises an IndexError mid-run, at TP > 1 the vocab-parallel embedding and
loss mask them and train on with a normal-looking loss. `check_token_ids` refuses such
a file with one sentence before the first iteration.

The maximum is one vectorised pass over the memory-mapped `.bin`, stored in the index
cache (index_cache.py) under the `.bin`'s path, size and modification time, so it is
computed once per file by rank 0 and read by every later run.
"""
from __future__ import annotations

import hashlib
import json
import os
from typing import Optional

import numpy as np

from .errors import DataError
from .index_cache import cached_arrays
from .indexed_dataset import IndexedDataset, bin_path

CHUNK_TOKENS = 1 << 26  # 64 Mi tokens per pass: bounded temporaries whatever the file size


def scan_max_token_id(path: str, dtype) -> int:
    """max over the token file (-1 when it is empty)."""
    if os.path.getsize(path) == 0:
        return -1
    tokens = np.memmap(path, dtype=dtype, mode="r")
    return max(int(tokens[i:i + CHUNK_TOKENS].max()) for i in range(0, len(tokens), CHUNK_TOKENS))


def max_token_id(indexed: IndexedDataset, cache_dir: Optional[str] = None) -> int:
    path = os.path.abspath(bin_path(indexed.prefix))
    stat = os.stat(path)
    desc = json.dumps({"class": "MaxTokenId", "bin": path, "bytes": stat.st_size, "mtime_ns": stat.st_mtime_ns,
                       "dtype": indexed.dtype.name}, indent=2)
    cache_dir = cache_dir or os.path.join(os.path.dirname(path), "cache", "GPTDataset_indices")
    base = f"{hashlib.md5(desc.encode()).hexdigest()}-MaxTokenId"
    arrays = cached_arrays(cache_dir, base, desc, ["max_token_id"],
                           lambda: {"max_token_id": np.array([scan_max_token_id(path, indexed.dtype)], np.int64)})
    return int(arrays["max_token_id"][0])


def check_token_ids(indexed: IndexedDataset, vocab_size: int, cache_dir: Optional[str] = None) -> int:
    """Refuse a dataset holding an id at or above the tokenizer's vocabulary; return its largest id."""
    top = max_token_id(indexed, cache_dir)
    if top >= vocab_size:
        raise DataError(f"the data file {bin_path(indexed.prefix)} holds token id {top} but the tokenizer's "
                        f"vocabulary has {vocab_size} ids (0 to {vocab_size - 1}), so it was tokenized with another "
                        "tokenizer; give the --tokenizer-type/--tokenizer-model it was made with, or preprocess it "
                        "again with this one")
    return top
