import os

import numpy as np
import pytest

from megatron_zero.data import gpt_dataset
from megatron_zero.data.builder import build_train_valid_test_datasets
from megatron_zero.data.index_cache import cached_arrays
from megatron_zero.data.indexed_dataset import IndexedDatasetBuilder


def _prefix(tmp):
    b = IndexedDatasetBuilder(os.path.join(tmp, "d"), np.uint16)
    rng = np.random.default_rng(0)
    for _ in range(30):
        b.add_document(rng.integers(0, 1000, int(rng.integers(1, 20))))
    b.finalize()
    return os.path.join(tmp, "d")


def build_on_ranks(prefix):
    """Runs on each gloo rank: count how often this rank builds the indices."""
    import torch.distributed as dist
    calls = []
    original = gpt_dataset.build_gpt_indices

    def counting(*a, **k):
        calls.append(dist.get_rank())
        return original(*a, **k)

    gpt_dataset.build_gpt_indices = counting
    try:
        train, _, _ = build_train_valid_test_datasets([prefix], "1,0,0", 8, 5, [40, None, None])
    finally:
        gpt_dataset.build_gpt_indices = original
    return len(calls), np.asarray(train.shuffle_index).tolist(), train[3].tolist()


def test_rank_zero_builds_and_the_others_read(tmp_path):
    from megatron_zero.testing import run_ranks
    prefix = _prefix(str(tmp_path))
    results = run_ranks(build_on_ranks, 2, prefix, timeout=120)
    assert [r[0] for r in results] == [1, 0]
    assert results[0][1:] == results[1][1:]
    train, _, _ = build_train_valid_test_datasets([prefix], "1,0,0", 8, 5, [40, None, None])
    assert np.asarray(train.shuffle_index).tolist() == results[0][1]  # single process reuses the cache


def test_failed_build_leaves_no_cache_entry(tmp_path):
    def broken():
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError):
        cached_arrays(str(tmp_path), "k", "desc", ["a", "b"], broken)
    assert sorted(os.listdir(tmp_path)) == ["k.lock"]

    def half():  # 'b' missing: the save fails after 'a' was written
        return {"a": np.arange(3)}

    with pytest.raises(KeyError):
        cached_arrays(str(tmp_path), "k", "desc", ["a", "b"], half)
    assert not any(f.endswith("description.txt") or f.endswith(".tmp") for f in os.listdir(tmp_path))
    built = cached_arrays(str(tmp_path), "k", "desc", ["a", "b"], lambda: {"a": np.arange(3), "b": np.ones(2)})
    assert built["b"].tolist() == [1.0, 1.0]
    # complete entries are read back, never rebuilt
    again = cached_arrays(str(tmp_path), "k", "desc", ["a", "b"], broken)
    assert again["a"].tolist() == [0, 1, 2]
