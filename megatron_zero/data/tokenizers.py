"""Tokenizers by Megatron's `--tokenizer-type` names, each with vocab_size, eod,
tokenize(text) -> list[int] and detokenize(ids) -> str.

    SentencePieceTokenizer     a `.model`; Megatron's special tokens (<CLS> <SEP> <EOD>
                               <MASK>, and <PAD>/<BOS>/<EOS> when the model has none) are
                               appended after the model's pieces; eod is <EOD>
    GPTSentencePieceTokenizer  a `.model` as is; eod is the model's eos id
    Llama2Tokenizer            a Llama `.model`: each text starts with the model's BOS; eod is its EOS
    GPT2BPETokenizer           vocab.json + merges.txt (hf_tokenizers.py, the `tokenizers` library)
    HuggingFaceTokenizer       a tokenizer.json or a directory holding one (hf_tokenizers.py)
    TikTokenizer               Megatron-LM's tiktoken JSON vocabulary (tiktoken_tokenizer.py, the `tiktoken`
                               package): 1000 special ids first (<unk> <s> </s> ...), eod </s>
    NullTokenizer              text is space-separated ids; eod = vocab_size (Megatron's)
    ByteTokenizer              UTF-8 bytes 0..255, eod 256 (ours, for tests)
"""
from __future__ import annotations

import os
from typing import List, Optional

from .errors import DataError
from .hf_tokenizers import GPT2BPETokenizer, HuggingFaceTokenizer

TOKENIZER_TYPES = ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer", "GPT2BPETokenizer",
                   "HuggingFaceTokenizer", "TikTokenizer", "NullTokenizer", "ByteTokenizer")


class ByteTokenizer:
    vocab_size = 257
    eod = 256

    def tokenize(self, text: str) -> List[int]:
        return list(text.encode("utf-8"))

    def detokenize(self, ids) -> str:
        return bytes(int(i) for i in ids if int(i) < 256).decode("utf-8", errors="replace")


class NullTokenizer:
    def __init__(self, vocab_size: int):
        self.eod = int(vocab_size)
        self.vocab_size = int(vocab_size) + 1

    def tokenize(self, text: str) -> List[int]:
        return [int(x) for x in text.split(" ")]

    def detokenize(self, ids) -> str:
        return " ".join(str(int(i)) for i in ids)


def _load_sentencepiece(model_file: str):
    import sentencepiece

    if not os.path.isfile(model_file):
        raise DataError(f"--tokenizer-model {model_file} does not exist.")
    try:
        return sentencepiece.SentencePieceProcessor(model_file=model_file)
    except (OSError, RuntimeError) as e:
        raise DataError(f"--tokenizer-model {model_file} is not a SentencePiece model ({e}).") from None


class GPTSentencePieceTokenizer:
    def __init__(self, model_file: str):
        self.sp = _load_sentencepiece(model_file)
        self.vocab_size = self.sp.get_piece_size()
        self.eod = self.sp.eos_id()
        if self.eod < 0:
            raise DataError(f"--tokenizer-model {model_file} has no eos piece, which GPTSentencePieceTokenizer uses as end of document.")

    def tokenize(self, text: str) -> List[int]:
        return self.sp.encode(text)

    def detokenize(self, ids) -> str:
        return self.sp.decode([int(i) for i in ids])


class Llama2Tokenizer(GPTSentencePieceTokenizer):
    """Megatron-LM's _Llama2Tokenizer: the SentencePiece model with BOS before each text (EOS is the eod)."""

    def __init__(self, model_file: str):
        super().__init__(model_file)
        self.bos = self.sp.bos_id()
        if self.bos < 0:
            raise DataError(f"--tokenizer-model {model_file} has no bos piece, which Llama2Tokenizer puts before "
                            "each text.")

    def tokenize(self, text: str) -> List[int]:
        return [self.bos] + self.sp.encode(text)


class SentencePieceTokenizer(GPTSentencePieceTokenizer):
    def __init__(self, model_file: str):
        self.sp = _load_sentencepiece(model_file)
        self.vocab = {self.sp.id_to_piece(i): i for i in range(self.sp.get_piece_size())}
        self.special = {}

        def add(token):
            if token not in self.vocab:
                self.vocab[token] = len(self.vocab)
            self.special[token] = self.vocab[token]
            return self.vocab[token]

        for t in ("<CLS>", "<SEP>", "<EOD>", "<MASK>"):
            add(t)
        for name, sp_id in (("<PAD>", self.sp.pad_id()), ("<BOS>", self.sp.bos_id()), ("<EOS>", self.sp.eos_id())):
            add(self.sp.id_to_piece(sp_id) if sp_id >= 0 else name)
        self.eod = self.special["<EOD>"]
        self.vocab_size = len(self.vocab)
        self._sp_size = self.sp.get_piece_size()

    def detokenize(self, ids) -> str:
        return self.sp.decode([int(i) for i in ids if int(i) < self._sp_size])


def build_tokenizer(tokenizer_type: str, tokenizer_model: Optional[str] = None, vocab_file: Optional[str] = None,
                    merge_file: Optional[str] = None, vocab_size: Optional[int] = None,
                    tiktoken_pattern: Optional[str] = None, tiktoken_num_special_tokens: int = 1000,
                    special_tokens: Optional[List[str]] = None):
    """Build a tokenizer from Megatron's flags (`--tokenizer-type`, `--tokenizer-model`, ...; the last three
    are TikTokenizer's --tiktoken-pattern, --tiktoken-num-special-tokens, --tokenizer-special-tokens)."""
    def need(value, flag):
        if value is None:
            raise DataError(f"--tokenizer-type {tokenizer_type} needs {flag}.")
        return value

    if tokenizer_type == "SentencePieceTokenizer":
        return SentencePieceTokenizer(need(tokenizer_model, "--tokenizer-model"))
    if tokenizer_type == "GPTSentencePieceTokenizer":
        return GPTSentencePieceTokenizer(need(tokenizer_model, "--tokenizer-model"))
    if tokenizer_type == "Llama2Tokenizer":
        return Llama2Tokenizer(need(tokenizer_model, "--tokenizer-model"))
    if tokenizer_type == "GPT2BPETokenizer":
        return GPT2BPETokenizer(need(vocab_file, "--vocab-file"), need(merge_file, "--merge-file"))
    if tokenizer_type == "HuggingFaceTokenizer":
        return HuggingFaceTokenizer(need(tokenizer_model, "--tokenizer-model"))
    if tokenizer_type == "TikTokenizer":
        from .tiktoken_tokenizer import TikTokenizer  # the tiktoken package only where it is used

        return TikTokenizer(need(tokenizer_model, "--tokenizer-model"), tiktoken_pattern, vocab_size,
                            tiktoken_num_special_tokens, special_tokens)
    if tokenizer_type == "NullTokenizer":
        return NullTokenizer(need(vocab_size, "--vocab-size"))
    if tokenizer_type == "ByteTokenizer":
        return ByteTokenizer()
    raise DataError(f"--tokenizer-type {tokenizer_type} is unknown; choose one of {', '.join(TOKENIZER_TYPES)}.")
