"""GPT samples of seq_length+1 tokens that run across document boundaries.

The index arrays follow Megatron-Core's GPTDataset exactly (same seed -> same samples):

    document_index  the split's documents repeated for each epoch, shuffled (int32)
    sample_index    [num_samples+1, 2]: (position in document_index, token offset)
                    where sample i starts; sample i ends where sample i+1 starts
                    (inclusive), so consecutive samples share one token
    shuffle_index   a permutation of the samples (uint32)

When the last epoch would contribute fewer than 80% of an epoch's samples it is
shuffled separately, so the early samples are not diluted by a partial epoch.
The arrays depend only on (data, split, seq_length, seed, num_samples) and are
cached next to the data (index_cache.py).
"""
from __future__ import annotations

import hashlib
import json
import os
from typing import Optional

import numpy as np

from .index_cache import cached_arrays
from .indexed_dataset import IndexedDataset, idx_path


def build_document_index(documents: np.ndarray, num_epochs: int, rng: np.random.RandomState,
                         separate_final_epoch: bool) -> np.ndarray:
    if not separate_final_epoch or num_epochs == 1:
        index = np.tile(documents.astype(np.int32), num_epochs)
        rng.shuffle(index)
        return index
    first = build_document_index(documents, num_epochs - 1, rng, False)
    return np.concatenate([first, build_document_index(documents, 1, rng, False)])


def build_sample_index(sizes: np.ndarray, document_index: np.ndarray, seq_length: int, num_epochs: int,
                       tokens_per_epoch: int) -> np.ndarray:
    """Sample i starts at token position i*seq_length of the document_index stream."""
    num_samples = (num_epochs * tokens_per_epoch - 1) // seq_length
    starts = np.zeros(len(document_index) + 1, dtype=np.int64)
    np.cumsum(sizes[document_index], out=starts[1:])
    pos = np.arange(num_samples + 1, dtype=np.int64) * seq_length
    doc = np.searchsorted(starts, pos, side="right") - 1  # the last document starting at or before pos
    doc[0] = 0  # sample 0 starts at the first document even if it is empty, as Megatron records it
    out_dtype = np.int32 if max(len(document_index), int(sizes.max(initial=0))) <= np.iinfo(np.int32).max else np.int64
    return np.stack([doc, pos - starts[doc]], axis=1).astype(out_dtype)


def build_shuffle_index(num_samples: int, total_size: int, rng: np.random.RandomState) -> np.ndarray:
    dtype = np.uint32 if total_size < np.iinfo(np.uint32).max - 1 else np.int64
    first = np.arange(num_samples, dtype=dtype)
    rng.shuffle(first)
    if num_samples == total_size:
        return first
    last = np.arange(num_samples, total_size, dtype=dtype)
    rng.shuffle(last)
    return np.concatenate([first, last])


def build_gpt_indices(sizes: np.ndarray, documents: np.ndarray, num_samples: Optional[int], seq_length: int, seed: int):
    tokens_per_epoch = int(np.sum(sizes[documents], dtype=np.int64))
    if tokens_per_epoch <= 1:
        raise ValueError(f"a split with {tokens_per_epoch} tokens cannot make GPT samples")
    num_epochs = 1
    if num_samples is not None:
        num_epochs = max(1, -(-(num_samples * seq_length + 1) // tokens_per_epoch))
    separate_final_epoch = False
    if num_epochs > 1:
        before_final = ((num_epochs - 1) * tokens_per_epoch - 1) // seq_length
        per_epoch = (tokens_per_epoch - 1) // seq_length
        separate_final_epoch = num_samples - before_final < int(0.80 * per_epoch)
    rng = np.random.RandomState(seed)
    document_index = build_document_index(documents, num_epochs, rng, separate_final_epoch)
    sample_index = build_sample_index(sizes, document_index, seq_length, num_epochs, tokens_per_epoch)
    total = sample_index.shape[0] - 1
    shuffle_index = build_shuffle_index(before_final if separate_final_epoch else total, total, rng)
    return {"document_index": document_index, "sample_index": sample_index, "shuffle_index": shuffle_index}


class GPTDataset:
    """`ds[i]` is an int64 array of seq_length+1 tokens; len(ds) >= num_samples (whole epochs)."""

    def __init__(self, indexed: IndexedDataset, split: str, documents: np.ndarray, num_samples: Optional[int],
                 seq_length: int, seed: int, cache_dir: Optional[str] = None):
        self.indexed, self.split, self.seq_length = indexed, split, seq_length
        prefix = os.path.abspath(indexed.prefix)
        desc = json.dumps({"class": "GPTDataset", "path_prefix": prefix, "idx_bytes": os.path.getsize(idx_path(prefix)),
                           "split": split, "documents": [int(documents[0]), int(documents[-1]) + 1] if len(documents) else [],
                           "num_samples": num_samples, "sequence_length": seq_length, "random_seed": seed}, indent=2)
        base = f"{hashlib.md5(desc.encode()).hexdigest()}-GPTDataset-{split}"
        cache_dir = cache_dir or os.path.join(os.path.dirname(prefix), "cache", "GPTDataset_indices")
        arrays = cached_arrays(cache_dir, base, desc, ["document_index", "sample_index", "shuffle_index"],
                               lambda: build_gpt_indices(np.asarray(indexed.sequence_lengths), documents,
                                                         num_samples, seq_length, seed))
        self.document_index = arrays["document_index"]
        self.sample_index = arrays["sample_index"]
        self.shuffle_index = arrays["shuffle_index"]

    def __len__(self) -> int:
        return self.sample_index.shape[0] - 1

    def __getitem__(self, idx: int) -> np.ndarray:
        i = int(self.shuffle_index[idx])
        (d0, o0), (d1, o1) = self.sample_index[i], self.sample_index[i + 1]
        d0, o0, d1, o1 = int(d0), int(o0), int(d1), int(o1)
        get, docs = self.indexed.get, self.document_index
        if d0 == d1:
            parts = [get(int(docs[d0]), o0, o1 - o0 + 1)]
        else:
            parts = [get(int(docs[d0]), o0)] + [get(int(docs[d])) for d in range(d0 + 1, d1)] + [get(int(docs[d1]), 0, o1 + 1)]
        return np.concatenate(parts).astype(np.int64)
