import os
import subprocess
import sys

from megatron_zero.data.builder import build_train_valid_test_datasets
from megatron_zero.data.corpus import TOKENIZER_TYPE, build_corpus
from megatron_zero.data.indexed_dataset import IndexedDataset
from megatron_zero.data.tokenizers import build_tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_builtin_corpus_builds_once_and_trains_on(tmp_path):
    out = build_corpus(str(tmp_path), vocab_size=1024, log=None)
    ds = IndexedDataset(out["data_prefix"])
    tok = build_tokenizer(TOKENIZER_TYPE, tokenizer_model=out["tokenizer_model"])
    assert tok.vocab_size == 1024 and ds.num_documents > 100 and ds.dtype.itemsize == 2
    first = ds.document(0)
    assert first[-1] == tok.eod and "the" in tok.detokenize(first[:-1])
    stamps = {f: os.path.getmtime(tmp_path / f) for f in os.listdir(tmp_path)}
    build_corpus(str(tmp_path), vocab_size=1024, log=None)
    assert {f: os.path.getmtime(tmp_path / f) for f in os.listdir(tmp_path)} == stamps  # nothing redone
    # a damaged dataset is rebuilt; the valid JSONL and model are kept
    with open(out["data_prefix"] + ".bin", "r+b") as f:
        f.truncate(100)
    build_corpus(str(tmp_path), vocab_size=1024, log=None)
    assert len(IndexedDataset(out["data_prefix"])) == len(ds)
    assert os.path.getmtime(out["tokenizer_model"]) == stamps["tokenizer.model"]
    train, valid, test = build_train_valid_test_datasets([out["data_prefix"]], "949,50,1", 64, 1234, [500, 20, 20])
    assert len(train) >= 500 and train[0].shape == (65,) and valid is not None


def test_build_corpus_cli_prints_shell_assignments(tmp_path):
    r = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "build_corpus.py"), "--output-dir",
                        str(tmp_path), "--vocab-size", "512"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    lines = dict(ln.split("=", 1) for ln in r.stdout.split())
    assert lines["TOKENIZER_TYPE"] == TOKENIZER_TYPE and lines["VOCAB_SIZE"] == "512"
    assert os.path.isfile(lines["DATA_PATH"] + ".idx") and os.path.isfile(lines["TOKENIZER_MODEL"])
    assert "docs/s" in r.stderr
