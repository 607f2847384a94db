import os
import struct

import numpy as np
import pytest

from megatron_zero.data.errors import DataError
from megatron_zero.data.gpt_dataset import GPTDataset
from megatron_zero.data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder


def _docs(seed=0, n=50, vocab=1000):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, size=int(rng.integers(0, 40))) for _ in range(n)]


def _write(prefix, docs, dtype=np.uint16):
    b = IndexedDatasetBuilder(prefix, dtype=dtype)
    for d in docs:
        b.add_document(d)
    b.finalize()
    return prefix


@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
def test_round_trip(tmp_path, dtype):
    docs = _docs()
    ds = IndexedDataset(_write(str(tmp_path / "x"), docs, dtype))
    assert len(ds) == len(docs) and ds.num_documents == len(docs) and ds.dtype == dtype
    for i, d in enumerate(docs):
        np.testing.assert_array_equal(ds[i], d)
        np.testing.assert_array_equal(ds.document(i), d)
    long = max(range(len(docs)), key=lambda i: len(docs[i]))
    np.testing.assert_array_equal(ds.get(long, 3, 5), docs[long][3:8])
    assert isinstance(ds._bin, np.memmap)  # mapped, never read whole
    assert not any(p.name.endswith(".tmp") for p in tmp_path.iterdir())


def test_idx_bytes_follow_megatron_format_read_with_numpy_alone(tmp_path):
    docs = [np.array([5, 6, 7]), np.array([], dtype=np.int64), np.array([1, 2])]
    prefix = _write(str(tmp_path / "x"), docs, np.uint16)
    raw = open(prefix + ".idx", "rb").read()
    expected = (b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", 8)
                + struct.pack("<Q", 3) + struct.pack("<Q", 4)
                + np.array([3, 0, 2], "<i4").tobytes()
                + np.array([0, 6, 6], "<i8").tobytes()
                + np.array([0, 1, 2, 3], "<i8").tobytes())
    assert raw == expected
    # independent numpy-only reader
    n_seq, n_doc = np.frombuffer(raw, "<u8", 2, 18)
    lengths = np.frombuffer(raw, "<i4", n_seq, 34)
    pointers = np.frombuffer(raw, "<i8", n_seq, 34 + 4 * n_seq)
    bin_ = np.fromfile(prefix + ".bin", dtype="<u2")
    for d, p, n in zip(docs, pointers, lengths):
        np.testing.assert_array_equal(bin_[p // 2:p // 2 + n], d)


def _expect(prefix, pattern):
    with pytest.raises(DataError, match=pattern) as e:
        IndexedDataset(prefix)
    msg = str(e.value)
    assert msg.count(". ") == 0 and msg.endswith(".")  # one sentence
    return msg


def test_truncated_and_mismatched_pairs_are_refused(tmp_path):
    a = _write(str(tmp_path / "a"), _docs(1))
    b = _write(str(tmp_path / "b"), _docs(2))
    data = open(a + ".bin", "rb").read()
    open(a + ".bin", "wb").write(data[:-4])
    assert "a.bin is truncated" in _expect(a, "truncated")
    open(a + ".bin", "wb").write(data + b"\0\0")
    assert "a.bin does not match" in _expect(a, "does not match")
    open(a + ".bin", "wb").write(data)
    idx = open(a + ".idx", "rb").read()
    open(a + ".idx", "wb").write(idx[:-8])
    assert "a.idx is truncated" in _expect(a, "truncated")
    open(a + ".idx", "wb").write(idx[:20])
    _expect(a, "shorter than the 34-byte header")
    open(a + ".idx", "wb").write(b"NOTANIDX" + idx[8:])
    _expect(a, "not a Megatron mmap index")
    # b's index with a's data: sizes disagree
    os.replace(b + ".idx", a + ".idx")
    _expect(a, "a.bin")
    os.remove(a + ".bin")
    _expect(a, "does not exist")



def test_byte_identical_with_megatron_core(tmp_path):
    mc = pytest.importorskip("megatron.core.datasets.indexed_dataset",
                             reason="megatron-core not installed (pip install megatron-core==0.16.1)")
    docs = _docs(3, n=80)
    ours = _write(str(tmp_path / "ours"), docs, np.uint16)
    theirs = str(tmp_path / "theirs")
    b = mc.IndexedDatasetBuilder(theirs + ".bin", dtype=np.uint16)
    for d in docs:
        b.add_document(d, [len(d)])
    b.finalize(theirs + ".idx")
    for ext in (".idx", ".bin"):
        assert open(ours + ext, "rb").read() == open(theirs + ext, "rb").read(), ext
    # each project reads the other's files
    their_reader = mc.IndexedDataset(ours)
    our_reader = IndexedDataset(theirs)
    for i, d in enumerate(docs):
        np.testing.assert_array_equal(their_reader[i], d)
        np.testing.assert_array_equal(our_reader[i], d)


def _write_like_megatron_deepspeed(prefix, docs, eod):
    """What Megatron-DeepSpeed's tools/preprocess_data.py --append-eod writes: each non-empty document's
    sentences and then the EOD into the .bin, the sentence lengths alone (no EOD) into the .idx."""
    from megatron.core.datasets.indexed_dataset import (
        IndexedDatasetBuilder as CoreBuilder,
    )

    builder = CoreBuilder(prefix + ".bin", dtype=np.uint16)
    for sentences in docs:
        ids = [t for s in sentences for t in s]
        lengths = [len(s) for s in sentences if len(s)]
        builder.add_document(np.array(ids + [eod] if ids else [], dtype=np.int64), lengths)
    builder.finalize(prefix + ".idx")
    return prefix


def test_megatron_deepspeed_append_eod_files_read_with_each_eod(tmp_path, capsys):
    rng = np.random.default_rng(3)
    eod = 999
    docs = [[list(rng.integers(0, 900, size=int(rng.integers(1, 9)))) for _ in range(int(rng.integers(0, 4)))]
            for _ in range(40)]
    docs[0] = [[1, 2, 3], [4, 5]]  # two sentences
    docs[1] = []  # empty document: no tokens, no EOD
    prefix = _write_like_megatron_deepspeed(str(tmp_path / "mds"), docs, eod)
    ds = IndexedDataset(prefix)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--append-eod" in err and f"token {eod}" in err and prefix + ".idx" in err
    assert ds.eod_uncounted == eod and ds.num_documents == len(docs)
    for d, sentences in enumerate(docs):
        ids = [t for s in sentences for t in s]
        np.testing.assert_array_equal(ds.document(d), ids + [eod] if ids else [])
    np.testing.assert_array_equal(ds[0], [1, 2, 3])
    np.testing.assert_array_equal(ds[1], [4, 5, eod])
    # GPT samples over it run through the EODs exactly like a pair written with the EOD counted
    builder = IndexedDatasetBuilder(str(tmp_path / "counted"), dtype=np.uint16)
    for sentences in docs:  # the EOD counted in the last sentence, as Megatron-LM's preprocess does
        lengths = [len(s) for s in sentences]
        builder.add_document([t for s in sentences for t in s] + ([eod] if lengths else []),
                             lengths[:-1] + [lengths[-1] + 1] if lengths else [])
    builder.finalize()
    counted = IndexedDataset(str(tmp_path / "counted"))
    np.testing.assert_array_equal(counted.sequence_lengths, ds.sequence_lengths)
    a = GPTDataset(ds, "train", np.arange(len(ds), dtype=np.int32), 20, 8, 1, str(tmp_path / "c1"))
    b = GPTDataset(counted, "train", np.arange(len(ds), dtype=np.int32), 20, 8, 1, str(tmp_path / "c2"))
    for i in range(20):
        np.testing.assert_array_equal(a[i], b[i])


def test_extra_tokens_that_are_not_eods_are_still_refused(tmp_path):
    docs = [[[1, 2, 3]], [[4, 5]], [[6]]]
    prefix = _write_like_megatron_deepspeed(str(tmp_path / "mds"), docs, 999)
    raw = np.fromfile(prefix + ".bin", dtype=np.uint16)
    raw[6] = 7  # the second document's EOD is no longer the same token as the others
    raw.tofile(prefix + ".bin")
    with pytest.raises(DataError, match="written by different runs"):
        IndexedDataset(prefix)
    one_more = _write(str(tmp_path / "plain"), [np.array([1, 2, 3])])
    with open(one_more + ".bin", "ab") as f:  # one stray token more per document, but no EOD layout ...
        f.write(np.array([999, 999], dtype=np.uint16).tobytes())
    with pytest.raises(DataError, match="written by different runs"):
        IndexedDataset(one_more)
