"""Several datasets mixed by weight (`--data-path 0.3 A 0.7 B`), as Megatron blends them.

Sample i comes from the dataset whose share is furthest behind its weight after
i samples (ties to the lowest index); each dataset is read in its own order.
"""
from __future__ import annotations

import hashlib
import json
from typing import List, Sequence

import numpy as np

from .index_cache import cached_arrays


def build_blending_indices(weights: Sequence[float], size: int):
    """(dataset_index int16[size], dataset_sample_index int64[size]), Megatron's greedy rule."""
    w = [float(x) for x in weights]
    counts = [0] * len(w)
    which = np.empty(size, dtype=np.int16)
    within = np.empty(size, dtype=np.int64)
    rng = range(len(w))
    for i in range(size):
        t = float(max(i, 1))
        best = max(rng, key=lambda d: (w[d] * t - counts[d], -d))
        which[i] = best
        within[i] = counts[best]
        counts[best] += 1
    return which, within


class BlendedDataset:
    def __init__(self, datasets: List, weights: Sequence[float], size: int, cache_dir: str,
                 description: str = ""):
        total = float(sum(weights))
        self.datasets, self.weights, self.size = datasets, [x / total for x in weights], size
        desc = json.dumps({"class": "BlendedDataset", "weights": self.weights, "size": size,
                           "datasets": description}, indent=2)
        base = f"{hashlib.md5(desc.encode()).hexdigest()}-BlendedDataset"
        arrays = cached_arrays(cache_dir, base, desc, ["dataset_index", "dataset_sample_index"],
                               lambda: dict(zip(["dataset_index", "dataset_sample_index"],
                                                build_blending_indices(self.weights, size))))
        self.dataset_index, self.dataset_sample_index = arrays["dataset_index"], arrays["dataset_sample_index"]
        for d, ds in enumerate(datasets):
            used = int(np.sum(self.dataset_index == d))
            if used > len(ds):
                raise ValueError(f"blended dataset {d} has {len(ds)} samples but the blend draws {used}")

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, idx: int) -> np.ndarray:
        return self.datasets[int(self.dataset_index[idx])][int(self.dataset_sample_index[idx])]
