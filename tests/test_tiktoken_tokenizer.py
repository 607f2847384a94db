"""--tokenizer-type TikTokenizer on a small tiktoken vocabulary trained here on the built-in corpus (no download):
ids and text against tiktoken itself (the file's ranks shifted by the 1000 special ids) and against
Megatron-Core's TikTokenTokenizer on the same file; its special tokens and vocabulary size; bad input in one
sentence; tools/preprocess_data.py and pretrain_gpt.py with it on the command line."""
import base64
import json
import os
import subprocess
import sys

import pytest

from megatron_zero.data import DataError
from megatron_zero.data.tiktoken_tokenizer import PATTERN_V1, PATTERN_V2
from megatron_zero.data.tokenizers import build_tokenizer
from megatron_zero.testing.launch import PRETRAIN, ROOT, losses_from_log
from megatron_zero.testing.tiny_tiktoken import tiktoken_vocab

SPECIAL = 1000
EXTRA = ["naïve café, 日本語 🙂", "getHTTPResponseCode()\n\n\tx = a/b  # done\r\n", "A </s> and <unk> in text"]


@pytest.fixture(scope="module")
def vocab(builtin_corpus, tmp_path_factory):
    """(vocabulary file, its entry count, corpus documents: the first 60 trained it, the next 20 test it)."""
    directory = os.path.dirname(builtin_corpus[0])
    with open(os.path.join(directory, "pydoc_topics.jsonl"), encoding="utf-8") as f:
        docs = [json.loads(line)["text"] for line in f][:80]
    path = tiktoken_vocab(str(tmp_path_factory.mktemp("tiktoken") / "vocab.json"), docs[:60], merges=120,
                          extra=[b"xQ"])  # a token v1 keeps whole (\p{L}+) and v2 splits at the case change
    with open(path) as f:
        count = len(json.load(f))
    return path, count, docs


def _tok(vocab, pattern="v2"):
    pytest.importorskip("tiktoken")  # installed with the test requirements; where it is not, these skip
    path, count, _ = vocab
    return build_tokenizer("TikTokenizer", path, vocab_size=count + SPECIAL, tiktoken_pattern=pattern)


def _direct(vocab, pattern):
    tiktoken = pytest.importorskip("tiktoken")
    with open(vocab[0]) as f:
        ranks = {base64.b64decode(e["token_bytes"]): e["rank"] for e in json.load(f)}
    return tiktoken.Encoding("direct", pat_str=pattern, mergeable_ranks=ranks, special_tokens={})


def test_ids_are_tiktokens_shifted_past_the_special_tokens(vocab):
    texts = vocab[2][60:] + EXTRA[:2]
    for pattern, regex in (("v1", PATTERN_V1), ("v2", PATTERN_V2)):
        tok, direct = _tok(vocab, pattern), _direct(vocab, regex)
        for text in texts:
            ids = tok.tokenize(text)
            assert ids == [i + SPECIAL for i in direct.encode(text)]
            assert tok.detokenize(ids) == text
    ids = [i for text in texts for i in _tok(vocab).tokenize(text)]
    assert max(ids) >= SPECIAL + 256 and len(ids) < sum(len(t.encode()) for t in texts)  # merges are used
    v1, v2 = _tok(vocab, "v1"), _tok(vocab, "v2")
    assert v1.tokenize("xQ") == [SPECIAL + vocab[1] - 1] and v2.tokenize("xQ") == [SPECIAL + ord("x"), SPECIAL + ord("Q")]


def test_special_tokens_and_vocabulary_size(vocab):
    tok = _tok(vocab)
    assert tok.vocab_size == vocab[1] + SPECIAL and tok.eod == 2 and (tok.unk, tok.bos) == (0, 1)
    assert tok.special_tokens[:8] == ["<unk>", "<s>", "</s>", "<mask>", "<pad>", "<cls>", "<sep>", "<SPECIAL_7>"]
    assert tok.detokenize([0, 1, 2, 999]) == "<unk><s></s><SPECIAL_999>"
    assert tok.tokenize("A </s>") == tok.tokenize("A ") + [2]  # written special tokens are their ids
    smaller = build_tokenizer("TikTokenizer", vocab[0], vocab_size=SPECIAL + 300, tiktoken_num_special_tokens=SPECIAL)
    assert smaller.vocab_size == 1300 and max(smaller.tokenize(vocab[2][70])) < 1300  # the file's first 300 ranks
    custom = build_tokenizer("TikTokenizer", vocab[0], vocab_size=vocab[1] + 20, tiktoken_num_special_tokens=20,
                             special_tokens=["<s>", "</s>", "<unk>", "<mask>", "<pad>", "<cls>", "<sep>", "<eod2>"])
    assert custom.eod == 1 and custom.tokenize(EXTRA[0]) == [i - SPECIAL + 20 for i in tok.tokenize(EXTRA[0])]


def test_same_ids_and_text_as_megatron_core(vocab):
    pytest.importorskip("tiktoken")
    mcore = pytest.importorskip("megatron.core.tokenizers.text.libraries.tiktoken_tokenizer")
    for pattern in ("v1", "v2"):
        theirs = mcore.TikTokenTokenizer(vocab[0], pattern=pattern, vocab_size=vocab[1] + SPECIAL)
        ours = _tok(vocab, pattern)
        assert (theirs.vocab_size, theirs.eod, theirs.special_tokens) == (ours.vocab_size, ours.eod, ours.special_tokens)
        for text in vocab[2][60:70] + EXTRA:
            ids = ours.tokenize(text)
            assert theirs.text_to_ids(text) == ids
            if text.isascii():  # megatron-core 0.16 decodes token by token, so a character whose UTF-8 bytes
                # span two tokens comes out as U+FFFD there; Megatron-LM d98e8a64dd decodes the joined bytes, as here
                assert theirs.ids_to_text(ids) == ours.detokenize(ids) == text


@pytest.mark.parametrize("kwargs,sentence", [
    ({}, "holds {n} tokens, fewer than --vocab-size 131072 minus 1000 special tokens; give --vocab-size {m} (or less)."),
    ({"tiktoken_pattern": "v3", "vocab_size": 1300}, "--tiktoken-pattern v3 is not v1 or v2."),
    ({"vocab_size": 900}, "--tiktoken-num-special-tokens 1000 must be at least the 7 special tokens and below "
                          "--vocab-size 900."),
    ({"vocab_size": 1300, "special_tokens": ["<s>", "</s>"]}, "must be distinct and include <unk> <s> </s>"),
])
def test_bad_settings_are_one_sentence(vocab, kwargs, sentence):
    pytest.importorskip("tiktoken")
    with pytest.raises(DataError) as err:
        build_tokenizer("TikTokenizer", vocab[0], **kwargs)
    assert sentence.format(n=vocab[1], m=vocab[1] + SPECIAL) in str(err.value)


def test_missing_package_is_one_sentence(vocab, monkeypatch):
    monkeypatch.setitem(sys.modules, "tiktoken", None)  # as if not installed (runs where it is not, too)
    with pytest.raises(DataError, match="needs the tiktoken package, which is not installed; pip install tiktoken"):
        build_tokenizer("TikTokenizer", vocab[0], vocab_size=1300)


def test_bad_file_is_one_sentence(tmp_path):
    pytest.importorskip("tiktoken")
    bad = tmp_path / "vocab.json"
    bad.write_text(json.dumps([{"rank": 0, "token_bytes": base64.b64encode(b"x").decode(), "token_str": "x"}]))
    with pytest.raises(DataError, match="entry 0 must be the single byte 0"):
        build_tokenizer("TikTokenizer", str(bad), vocab_size=1300)
    bad.write_text("{}")
    with pytest.raises(DataError, match="must hold a JSON list"):
        build_tokenizer("TikTokenizer", str(bad), vocab_size=1300)
    with pytest.raises(DataError, match="is not a tiktoken vocabulary .json file"):
        build_tokenizer("TikTokenizer", str(tmp_path / "missing.json"), vocab_size=1300)


def test_preprocess_and_train_on_the_command_line(vocab, tmp_path):
    pytest.importorskip("tiktoken")
    path, count, docs = vocab
    size = str(count + SPECIAL)
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text("".join(json.dumps({"text": t}) + "\n" for t in docs[:40]))
    tok_flags = ["--tokenizer-type", "TikTokenizer", "--tokenizer-model", path, "--tiktoken-pattern", "v2",
                 "--vocab-size", size]
    prep = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "preprocess_data.py"), "--input", str(jsonl),
                           "--output-prefix", str(tmp_path / "tt"), "--append-eod"] + tok_flags,
                          capture_output=True, text=True)
    assert prep.returncode == 0, prep.stderr
    from megatron_zero.data.indexed_dataset import IndexedDataset

    data = IndexedDataset(str(tmp_path / "tt_text_document"))
    tok = _tok(vocab)
    assert list(data[3]) == tok.tokenize(docs[3]) + [tok.eod]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, PRETRAIN, "--num-layers", "1", "--hidden-size", "32", "--num-attention-heads",
                          "4", "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "2", "--lr",
                          "1e-3", "--train-iters", "2", "--log-interval", "1", "--eval-iters", "0", "--data-path",
                          str(tmp_path / "tt_text_document"), "--split", "100,0,0", "--data-cache-path",
                          str(tmp_path / "cache"), "--save", str(tmp_path / "ckpt")] + tok_flags,
                         capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert len(losses_from_log(run.stdout)) == 2
    gen = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "generate_text.py"), "--load",
                          str(tmp_path / "ckpt"), "--prompt", "The class", "--max-new-tokens", "3", "--greedy"],
                         capture_output=True, text=True, env=env, timeout=300)  # the tokenizer as the run saved it
    assert gen.returncode == 0 and gen.stdout.startswith("The class"), gen.stderr[-2000:]
