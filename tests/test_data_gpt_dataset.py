import os

import numpy as np
import pytest

from megatron_zero.data.builder import build_train_valid_test_datasets, parse_data_path, parse_split
from megatron_zero.data.collate import collate_gpt
from megatron_zero.data.gpt_dataset import GPTDataset, build_gpt_indices
from megatron_zero.data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder
from megatron_zero.data.sampler import GlobalBatchSampler


def _write(prefix, n_docs=40, seed=0, empty_every=9):
    rng = np.random.default_rng(seed)
    b = IndexedDatasetBuilder(prefix, np.uint16)
    docs = []
    for d in range(n_docs):
        n = 0 if d % empty_every == 4 else int(rng.integers(1, 30))
        docs.append(rng.integers(0, 60000, n))
        b.add_document(docs[-1], [n] if n else [])
    b.finalize()
    return prefix, docs


def test_samples_are_consecutive_slices_of_the_document_stream(tmp_path):
    prefix, docs = _write(str(tmp_path / "d"))
    seq = 16
    ds = GPTDataset(IndexedDataset(prefix), "train", np.arange(len(IndexedDataset(prefix)), dtype=np.int32),
                    num_samples=100, seq_length=seq, seed=7)
    ix = IndexedDataset(prefix)
    stream = np.concatenate([ix[int(d)] for d in ds.document_index]).astype(np.int64)
    assert len(ds) >= 100 and len(set(ds.shuffle_index.tolist())) == len(ds)
    for k in range(len(ds)):
        i = int(ds.shuffle_index[k])
        np.testing.assert_array_equal(ds[k], stream[i * seq:i * seq + seq + 1])
    # more than one epoch was needed: every document appears several times
    assert len(ds.document_index) % len(ix) == 0 and len(ds.document_index) // len(ix) > 1


def test_indices_equal_megatron_core(tmp_path):
    gd = pytest.importorskip("megatron.core.datasets.gpt_dataset",
                             reason="megatron-core not installed (pip install megatron-core==0.16.1)")
    try:
        from megatron.core.datasets import helpers
    except ImportError:
        pytest.skip("megatron-core's C++ helpers are not built")
    prefix, _ = _write(str(tmp_path / "d"), n_docs=60)
    sizes = np.asarray(IndexedDataset(prefix).sequence_lengths)
    docs = np.arange(3, 50, dtype=np.int32)
    tokens = int(sizes[docs].sum())
    for num_samples, seq in [(10, 8), (300, 8), (41, 32), (1, 5)]:
        ours = build_gpt_indices(sizes, docs, num_samples, seq, seed=1234)
        epochs = max(1, -(-(num_samples * seq + 1) // tokens))
        sep = False
        if epochs > 1:
            before = ((epochs - 1) * tokens - 1) // seq
            sep = num_samples - before < int(0.8 * ((tokens - 1) // seq))
        rng = np.random.RandomState(1234)
        doc_index = gd._build_document_index(docs, epochs, rng, sep)
        sample_index = helpers.build_sample_idx(sizes, doc_index, seq, epochs, tokens, True, True)
        n = sample_index.shape[0] - 1
        shuffle = gd._build_shuffle_index(before if sep else n, n, rng)
        np.testing.assert_array_equal(ours["document_index"], doc_index)
        np.testing.assert_array_equal(ours["sample_index"], sample_index)
        assert ours["sample_index"].dtype == sample_index.dtype
        np.testing.assert_array_equal(ours["shuffle_index"], shuffle)
        assert ours["shuffle_index"].dtype == shuffle.dtype


def test_split_and_cache(tmp_path):
    prefix, _ = _write(str(tmp_path / "d"), n_docs=100)
    cache = str(tmp_path / "cache")
    train, valid, test = build_train_valid_test_datasets([prefix], "949,50,1", 8, 3, [50, 10, 5], cache)
    assert test is None or len(test) >= 5  # 1/1000 of 100 documents rounds to none
    n = len(IndexedDataset(prefix))  # sequences; empty documents have none
    cut = int(round(0.949 * n))
    assert valid.document_index.min() >= cut and train.document_index.max() < cut
    files = sorted(os.listdir(cache))
    assert sum(f.endswith("-description.txt") for f in files) == (3 if test is not None else 2)
    again, _, _ = build_train_valid_test_datasets([prefix], "949,50,1", 8, 3, [50, 10, 5], cache)
    assert isinstance(again.shuffle_index, np.memmap)  # loaded, not rebuilt
    assert sorted(os.listdir(cache)) == files
    np.testing.assert_array_equal(again[7], train[7])
    other, _, _ = build_train_valid_test_datasets([prefix], "949,50,1", 8, 4, [50, 10, 5], cache)
    assert not np.array_equal(other.shuffle_index, train.shuffle_index)  # seed is part of the key
    assert parse_split("949,50,1")[2] == pytest.approx((0.999, 1.0))
    assert parse_split("1,0,0")[1:] == [None, None]
    assert parse_data_path(["0.3", "A", "0.7", "B"]) == (["A", "B"], [0.3, 0.7])
    assert parse_data_path(["A", "B"]) == (["A", "B"], None)


def test_blend_follows_weights(tmp_path):
    a, _ = _write(str(tmp_path / "a"), n_docs=30, seed=1)
    b, _ = _write(str(tmp_path / "b"), n_docs=30, seed=2)
    train, valid, _ = build_train_valid_test_datasets(["0.3", a, "0.7", b], "90,10,0", 8, 1, [200, 20, None],
                                                      str(tmp_path / "cache"))
    assert len(train) == 200
    counts = np.bincount(np.asarray(train.dataset_index), minlength=2)
    assert counts.tolist() == [60, 140]
    # B is furthest behind its weight at i=0 (0.7 > 0.3), then A at i=1 (0.3 > 0.7 - 1)
    np.testing.assert_array_equal(train[0], train.datasets[1][0])
    np.testing.assert_array_equal(train[1], train.datasets[0][0])
    try:
        from megatron.core.datasets import helpers
    except ImportError:
        helpers = None
    if helpers is not None:
        which = np.zeros(200, dtype=np.int16)
        within = np.zeros(200, dtype=np.int64)
        helpers.build_blending_indices(which, within, np.array([0.3, 0.7]), 2, 200, False)
        np.testing.assert_array_equal(train.dataset_index, which)
        np.testing.assert_array_equal(train.dataset_sample_index, within)
    assert len(valid) == 20


def test_collate_and_micro_batches(tmp_path):
    prefix, _ = _write(str(tmp_path / "d"))
    train, _, _ = build_train_valid_test_datasets([prefix], "1,0,0", 8, 0, [32, None, None])
    s = GlobalBatchSampler(32, 8, micro_batch_size=2, global_batch_size=8, dp_rank=1, dp_size=2)
    batches = [collate_gpt([train[i] for i in indices]) for indices in s]  # what the trainer does per micro-batch
    assert len(batches) == 6
    b = batches[0]
    assert b["tokens"].shape == (2, 8) and b["tokens"].dtype.is_floating_point is False
    sample = train[10]  # rank 1, micro-batch 0 of global batch 1 = samples 10, 11
    assert b["tokens"][0].tolist() == sample[:-1].tolist() and b["labels"][0].tolist() == sample[1:].tolist()
    c = collate_gpt([np.arange(5), np.arange(5) + 1])
    assert c["labels"].tolist() == [[1, 2, 3, 4], [2, 3, 4, 5]]
