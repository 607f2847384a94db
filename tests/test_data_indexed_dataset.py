import os
import struct

import numpy as np
import pytest

from megatron_zero.data.errors import DataError
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
