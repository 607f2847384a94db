"""Megatron's `--data-path` / `--split` into train, valid and test datasets."""
from __future__ import annotations

import math
import os
import re
from typing import List, Optional, Sequence, Tuple

import numpy as np

from .blended_dataset import BlendedDataset
from .errors import DataError
from .gpt_dataset import GPTDataset
from .indexed_dataset import IndexedDataset
from .mock_dataset import MockGPTDataset
from .token_range import check_token_ids

SPLITS = ("train", "valid", "test")
BLEND_SURPLUS = 0.005  # Megatron's mid_level_dataset_surplus


def parse_data_path(data_path: Sequence[str]) -> Tuple[List[str], Optional[List[float]]]:
    """`['A']`, `['A', 'B']` or `['0.3', 'A', '0.7', 'B']` -> (prefixes, weights or None)."""
    items = list(data_path)
    if len(items) % 2 == 0 and items:
        try:
            weights = [float(items[i]) for i in range(0, len(items), 2)]
        except ValueError:
            weights = None
        if weights is not None:
            if any(w <= 0 for w in weights):
                raise DataError(f"--data-path weights must be positive, got {weights}.")
            return [items[i + 1] for i in range(0, len(items), 2)], weights
    return items, None


def parse_split(split: str) -> List[Optional[Tuple[float, float]]]:
    """'949,50,1' -> bookends [(0, .949), (.949, .999), (.999, 1.0)]; None for an empty split."""
    parts = [float(x) for x in re.findall(r"[.0-9]+", split)]
    parts += [0.0] * (3 - len(parts))
    if len(parts) != 3 or sum(parts) <= 0:
        raise DataError(f"--split {split!r} must be up to three non-negative weights such as 949,50,1.")
    total = sum(parts)
    ends = np.cumsum([0.0] + [p / total for p in parts]).tolist()
    return [(ends[i], ends[i + 1]) if parts[i] > 0 else None for i in range(3)]


def _gpt_splits(prefix, bookends, seq_length, seed, num_samples, cache_dir, vocab_size, mmap_bin=True):
    indexed = IndexedDataset(prefix, mmap_bin)
    if vocab_size is not None:
        check_token_ids(indexed, vocab_size, cache_dir)
    n = len(indexed)
    out = []
    for name, be, ns in zip(SPLITS, bookends, num_samples):
        if be is None:
            out.append(None)
            continue
        beg, end = int(round(be[0] * n)), int(round(be[1] * n))
        if end <= beg:
            out.append(None)
            continue
        out.append(GPTDataset(indexed, name, np.arange(beg, end, dtype=np.int32), ns, seq_length, seed, cache_dir))
    return out


def build_train_valid_test_datasets(data_prefix: Sequence[str], splits_string: str, seq_length: int, seed: int,
                                    train_valid_test_num_samples: Sequence[Optional[int]],
                                    cache_dir: Optional[str] = None, vocab_size: Optional[int] = None,
                                    mock: bool = False, mmap_bin: bool = True):
    """(train, valid, test) datasets of GPT samples; a split of weight 0 is None.

    data_prefix is Megatron's --data-path list; num_samples per split are the samples the
    loop will draw (e.g. train_iters * global_batch_size). With vocab_size, a dataset holding a
    larger token id is refused (token_range.py). Every rank must call this
    (rank 0 builds the cached indices while the others wait). mock (--mock-data): synthetic samples
    (mock_dataset.py) in the splits' proportions; mmap_bin False (--no-mmap-bin-files): plain reads.
    """
    if mock:
        return tuple(None if be is None or not ns else MockGPTDataset(ns, seq_length, vocab_size, seed, k)
                     for k, (be, ns) in enumerate(zip(parse_split(splits_string), train_valid_test_num_samples)))
    prefixes, weights = parse_data_path(data_prefix)
    if not prefixes:
        raise DataError("--data-path is empty; give one or more dataset prefixes (optionally with weights).")
    bookends = parse_split(splits_string)
    if len(prefixes) == 1:
        return tuple(_gpt_splits(prefixes[0], bookends, seq_length, seed, train_valid_test_num_samples, cache_dir,
                                 vocab_size, mmap_bin))
    weights = weights or [1.0] * len(prefixes)
    norm = [w / sum(weights) for w in weights]
    per_dataset = [_gpt_splits(p, bookends, seq_length, seed,
                               [None if t is None else int(math.ceil(math.ceil(t * w) * (1 + BLEND_SURPLUS)))
                                for t in train_valid_test_num_samples], cache_dir, vocab_size, mmap_bin)
                   for p, w in zip(prefixes, norm)]
    out = []
    for s, name in enumerate(SPLITS):
        parts = [d[s] for d in per_dataset]
        target = train_valid_test_num_samples[s]
        if any(p is None for p in parts) or target is None:
            out.append(None)
            continue
        desc = repr([(os.path.abspath(p), name, seq_length, seed) for p in prefixes])
        blend_cache = cache_dir or os.path.join(os.path.dirname(os.path.abspath(prefixes[0])), "cache", "BlendedDataset_indices")
        out.append(BlendedDataset(parts, norm, int(target), blend_cache, desc))
    return tuple(out)
