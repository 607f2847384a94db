"""Tokenizers backed by Hugging Face's `tokenizers` library (Rust).

    HuggingFaceTokenizer(path)             a `tokenizer.json`, or a directory holding one (Llama-3, Mistral,
                                           GPT-2, ... as saved by transformers); special tokens are added the
                                           way the file's post-processor says (e.g. Llama's BOS), as Megatron's
                                           HuggingFaceTokenizer does; eod is the eos token named by the
                                           directory's tokenizer_config.json, else a well-known end token
    GPT2BPETokenizer(vocab, merges)        GPT-2's byte-level BPE from vocab.json + merges.txt (Megatron's
                                           GPT2BPETokenizer); eod is `<|endoftext|>`, which in text is just text

Both: vocab_size, eod, tokenize(text) -> list[int], detokenize(ids) -> str.
"""
from __future__ import annotations

import json
import os
from typing import List

from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from .errors import DataError

END_TOKENS = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|im_end|>")


def _eos_from_config(directory: str):
    path = os.path.join(directory, "tokenizer_config.json")
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            eos = json.load(f).get("eos_token")
    except (OSError, ValueError) as e:
        raise DataError(f"{path} is not a readable JSON file ({e}).") from None
    return eos.get("content") if isinstance(eos, dict) else eos


class _Wrapped:
    def __init__(self, tokenizer: Tokenizer, add_special_tokens: bool):
        self.tokenizer, self.add_special_tokens = tokenizer, add_special_tokens
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)

    def tokenize(self, text: str) -> List[int]:
        return self.tokenizer.encode(text, add_special_tokens=self.add_special_tokens).ids

    def detokenize(self, ids) -> str:
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)


class HuggingFaceTokenizer(_Wrapped):
    def __init__(self, path: str):
        directory, file = (path, os.path.join(path, "tokenizer.json")) if os.path.isdir(path) else \
            (os.path.dirname(path), path)
        if not os.path.isfile(file):
            raise DataError(f"--tokenizer-model {path} is neither a tokenizer.json nor a directory holding one.")
        try:
            tokenizer = Tokenizer.from_file(file)
        except Exception as e:  # the library raises its own Exception subclass for bad files
            raise DataError(f"--tokenizer-model {file} is not a Hugging Face tokenizer.json ({e}).") from None
        super().__init__(tokenizer, add_special_tokens=True)
        eos = _eos_from_config(directory)
        candidates = [eos] if eos else list(END_TOKENS)
        found = [tokenizer.token_to_id(t) for t in candidates if tokenizer.token_to_id(t) is not None]
        if not found:
            raise DataError(f"--tokenizer-model {path}: the tokenizer has no end token ({', '.join(candidates)}), "
                            "which is used as end of document; name it as eos_token in tokenizer_config.json.")
        self.eod = found[0]


class GPT2BPETokenizer(_Wrapped):
    def __init__(self, vocab_file: str, merge_file: str):
        for path in (vocab_file, merge_file):
            if not os.path.isfile(path):
                raise DataError(f"{path} does not exist (GPT2BPETokenizer needs --vocab-file and --merge-file).")
        try:
            bpe = models.BPE.from_file(vocab_file, merge_file)
        except Exception as e:  # the library raises its own Exception subclass for bad files
            raise DataError(f"{vocab_file} and {merge_file} are not a GPT-2 vocab.json and merges.txt ({e}).") from None
        tokenizer = Tokenizer(bpe)
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = decoders.ByteLevel()
        super().__init__(tokenizer, add_special_tokens=False)
        self.eod = tokenizer.token_to_id("<|endoftext|>")
        if self.eod is None:
            raise DataError(f"{vocab_file} has no '<|endoftext|>' entry, which GPT-2 BPE uses as end of document.")
