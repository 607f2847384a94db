import json
import os
import subprocess
import sys

import numpy as np
import pytest

from megatron_zero.data.errors import DataError
from megatron_zero.data.indexed_dataset import IndexedDataset
from megatron_zero.data.preprocess import preprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = [{"text": "hello world", "title": "a"}, {"text": "", "title": "empty"},
        {"text": "ünïcode ✓", "title": "c"}, {"text": "x" * 300, "title": "long"}]


def _jsonl(path, docs, extra_lines=()):
    lines = [json.dumps(d) for d in docs]
    for at, bad in extra_lines:
        lines.insert(at, bad)
    path.write_text("\n".join(lines) + "\n")
    return str(path)


@pytest.mark.parametrize("workers", [1, 2])
def test_documents_round_trip_with_eod(tmp_path, workers):
    src = _jsonl(tmp_path / "in.jsonl", DOCS)
    stats = preprocess(src, str(tmp_path / "out"), "ByteTokenizer", json_keys=["text", "title"],
                       append_eod=True, workers=workers, log=None)
    assert stats.documents == 4 and stats.bytes == os.path.getsize(src)
    for key in ("text", "title"):
        ds = IndexedDataset(str(tmp_path / f"out_{key}_document"))
        assert ds.num_documents == 4 and ds.dtype == np.uint16
        for i, d in enumerate(DOCS):
            want = list(d[key].encode()) + ([256] if d[key] else [])  # Megatron: no eod on empty docs
            np.testing.assert_array_equal(ds.document(i), want)
    # the empty document has no sequence, as Megatron's preprocess writes it
    ds = IndexedDataset(str(tmp_path / "out_text_document"))
    assert list(ds.document_indices) == [0, 1, 1, 2, 3]


def test_output_does_not_depend_on_workers(tmp_path):
    docs = [{"text": f"document {i} " * (i % 7)} for i in range(300)]
    src = _jsonl(tmp_path / "in.jsonl", docs)
    for w in (1, 2):
        preprocess(src, str(tmp_path / f"w{w}"), "ByteTokenizer", append_eod=True, workers=w, log=None)
    for ext in (".bin", ".idx"):
        a = open(tmp_path / f"w1_text_document{ext}", "rb").read()
        assert a == open(tmp_path / f"w2_text_document{ext}", "rb").read()


def test_bad_lines_name_file_and_line(tmp_path):
    src = _jsonl(tmp_path / "in.jsonl", DOCS, [(2, '{"text": "unterminated'), (4, '{"body": "x"}')])
    with pytest.raises(DataError, match=r"in\.jsonl line 3 is not valid JSON"):
        preprocess(src, str(tmp_path / "out"), "ByteTokenizer", workers=2, log=None)
    assert not list(tmp_path.glob("out*"))  # nothing half-written is left behind
    stats = preprocess(src, str(tmp_path / "out"), "ByteTokenizer", skip_bad_lines=True, log=None)
    assert stats.documents == 4 and len(stats.skipped) == 2
    assert "line 5 has no key 'text'" in stats.skipped[1]
    assert IndexedDataset(str(tmp_path / "out_text_document")).num_documents == 4


def test_cli_prints_one_sentence_and_exits_2(tmp_path):
    src = _jsonl(tmp_path / "in.jsonl", DOCS, [(1, '{"title": "no text"}')])
    tool = os.path.join(ROOT, "tools", "preprocess_data.py")
    args = [sys.executable, tool, "--input", src, "--output-prefix", str(tmp_path / "o"),
            "--tokenizer-type", "ByteTokenizer", "--workers", "1"]
    r = subprocess.run(args, capture_output=True, text=True)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip() == f"{src} line 2 has no key 'text' (its keys are 'title')."
    r = subprocess.run(args + ["--skip-bad-lines", "--append-eod"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "docs/s" in r.stderr and "MB/s" in r.stderr and "1 bad lines skipped" in r.stderr


def test_megatron_core_reads_our_preprocessed_output(tmp_path):
    mc = pytest.importorskip("megatron.core.datasets.indexed_dataset",
                             reason="megatron-core not installed (pip install megatron-core==0.16.1)")
    src = _jsonl(tmp_path / "in.jsonl", DOCS)
    preprocess(src, str(tmp_path / "out"), "ByteTokenizer", append_eod=True, log=None)
    theirs = mc.IndexedDataset(str(tmp_path / "out_text_document"))
    ours = IndexedDataset(str(tmp_path / "out_text_document"))
    assert len(theirs) == len(ours) == 3
    np.testing.assert_array_equal(theirs.document_indices, ours.document_indices)
    for i in range(len(ours)):
        np.testing.assert_array_equal(theirs[i], ours[i])
