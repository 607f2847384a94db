import json

import pytest
from tokenizers.pre_tokenizers import ByteLevel

from megatron_zero.data.errors import DataError
from megatron_zero.data.tokenizer_training import train_sentencepiece
from megatron_zero.data.tokenizers import build_tokenizer
from megatron_zero.testing.tiny_tokenizer import byte_level_bpe

MERGES = ["h e", "l l", "he ll", "hell o", "Ġ w", "o r", "Ġw or", "Ġwor l", "Ġworl d"]


@pytest.fixture
def tiny_gpt2(tmp_path):
    vocab = {c: i for i, c in enumerate(sorted(ByteLevel.alphabet()))}  # GPT-2's 256 byte symbols
    for m in MERGES:
        vocab["".join(m.split())] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    (tmp_path / "vocab.json").write_text(json.dumps(vocab))
    (tmp_path / "merges.txt").write_text("#version: 0.2\n" + "\n".join(MERGES) + "\n")
    return build_tokenizer("GPT2BPETokenizer", vocab_file=str(tmp_path / "vocab.json"),
                           merge_file=str(tmp_path / "merges.txt")), vocab


def test_gpt2_bpe_on_hand_made_vocab(tiny_gpt2):
    tok, vocab = tiny_gpt2
    assert tok.vocab_size == 256 + len(MERGES) + 1 and tok.eod == vocab["<|endoftext|>"]
    assert tok.tokenize("hello world") == [vocab["hello"], vocab["Ġworld"]]
    # "hel" stops after "he" (no "he l" merge); bytes outside the merges stay single
    assert tok.tokenize("hel") == [vocab["he"], vocab["l"]]
    text = "Hello, wörld!  It's 3½ — ok\n"
    ids = tok.tokenize(text)
    assert tok.detokenize(ids) == text
    assert ids[:4] == [vocab["H"], vocab["e"], vocab["ll"], vocab["o"]]
    assert len(ids) == len(text.encode("utf-8")) - 2  # only "ll" and "Ġw" merge; the rest are bytes


def test_gpt2_pretokenizer_matches_regex_package(tiny_gpt2):
    """GPT-2's split (its published `regex` pattern) is what GPT2BPETokenizer's pre-tokenizer does."""
    pre = tiny_gpt2[0].tokenizer.pre_tokenizer
    split = lambda text: [text[a:b] for _, (a, b) in pre.pre_tokenize_str(text)]  # noqa: E731
    assert split("I'm 42  x²!\x1c ") == ["I", "'m", " 42", " ", " x", "²", "!\x1c", " "]
    regex = pytest.importorskip("regex", reason="the `regex` package is not installed")
    ref = regex.compile(r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""")
    import pydoc_data.topics
    text = "\n".join(list(pydoc_data.topics.topics.values())[:20]) + " Ⅻ x² _a_ ½ 一二 ٣ \t\n "
    assert split(text) == ref.findall(text)


def test_byte_and_null_tokenizers():
    b = build_tokenizer("ByteTokenizer")
    assert (b.vocab_size, b.eod) == (257, 256)
    assert b.tokenize("hé") == [104, 195, 169] and b.detokenize([104, 195, 169, 256]) == "hé"
    n = build_tokenizer("NullTokenizer", vocab_size=100)
    assert (n.vocab_size, n.eod) == (101, 100)
    assert n.tokenize("3 1 4") == [3, 1, 4] and n.detokenize([3, 1, 4]) == "3 1 4"


def test_sentencepiece_training_is_deterministic_and_megatron_specials(tmp_path):
    import pydoc_data.topics
    texts = list(pydoc_data.topics.topics.values())[:15]
    m1 = train_sentencepiece(texts, str(tmp_path / "a"), vocab_size=400)
    m2 = train_sentencepiece(texts, str(tmp_path / "b"), vocab_size=400)
    assert open(m1, "rb").read() == open(m2, "rb").read()
    assert open(m1[:-6] + ".vocab").read() == open(m2[:-6] + ".vocab").read()
    gpt = build_tokenizer("GPTSentencePieceTokenizer", tokenizer_model=m1)
    assert gpt.vocab_size == 400 and gpt.eod == 2
    sp = build_tokenizer("SentencePieceTokenizer", tokenizer_model=m1)
    # <CLS> <SEP> <EOD> <MASK> <PAD> appended; <BOS>/<EOS> are the model's own pieces
    assert sp.vocab_size == 405 and sp.eod == 402
    text = "The for statement is used to iterate over the elements of a sequence."
    assert sp.tokenize(text) == gpt.tokenize(text)
    assert gpt.detokenize(gpt.tokenize(text)) == text and sp.detokenize(sp.tokenize(text) + [sp.eod]) == text


def test_missing_flags_and_files_are_one_sentence(tmp_path):
    with pytest.raises(DataError, match="needs --tokenizer-model"):
        build_tokenizer("SentencePieceTokenizer")
    with pytest.raises(DataError, match="does not exist"):
        build_tokenizer("GPTSentencePieceTokenizer", tokenizer_model=str(tmp_path / "nope.model"))
    with pytest.raises(DataError, match="unknown"):
        build_tokenizer("BertWordPieceLowerCase")


def test_huggingface_tokenizer_matches_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    path = byte_level_bpe(str(tmp_path / "llama_like"), 400, bos="<s>", eos="</s>")
    by_dir = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(tmp_path / "llama_like"))
    by_file = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=path)
    ref = transformers.PreTrainedTokenizerFast(tokenizer_file=path)
    text = "The for statement is used to iterate over the elements of a sequence. é ½ 一"
    ids = by_dir.tokenize(text)
    assert ids == by_file.tokenize(text) == ref(text)["input_ids"] and ids[0] == ref.convert_tokens_to_ids("<s>")
    assert by_dir.vocab_size == len(ref) == 400 and by_dir.eod == ref.convert_tokens_to_ids("</s>")
    assert by_dir.detokenize(ids) == "<s>" + text == ref.decode(ids)
    gpt2_dir = tmp_path / "gpt2_like"
    byte_level_bpe(str(gpt2_dir), 400)
    bpe = build_tokenizer("GPT2BPETokenizer", vocab_file=str(gpt2_dir / "vocab.json"),
                          merge_file=str(gpt2_dir / "merges.txt"))
    hf = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(gpt2_dir))
    assert bpe.tokenize(text) == hf.tokenize(text) and bpe.eod == hf.eod and bpe.vocab_size == hf.vocab_size


def test_huggingface_tokenizer_bad_input_is_one_sentence(tmp_path):
    with pytest.raises(DataError, match="needs --tokenizer-model"):
        build_tokenizer("HuggingFaceTokenizer")
    with pytest.raises(DataError, match="neither a tokenizer.json nor a directory holding one"):
        build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(tmp_path))
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(DataError, match="is not a Hugging Face tokenizer.json"):
        build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(tmp_path))
    byte_level_bpe(str(tmp_path / "noend"), 300, eos="<x>")
    (tmp_path / "noend" / "tokenizer_config.json").write_text("{}")
    with pytest.raises(DataError, match="has no end token"):
        build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(tmp_path / "noend"))
    (tmp_path / "merges.txt").write_text("a b\n")
    with pytest.raises(DataError, match="not a GPT-2 vocab.json and merges.txt"):
        build_tokenizer("GPT2BPETokenizer", vocab_file=str(tmp_path / "tokenizer.json"),
                        merge_file=str(tmp_path / "merges.txt"))
