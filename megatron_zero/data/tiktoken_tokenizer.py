"""--tokenizer-type TikTokenizer: Megatron-LM's tiktoken BPE over its JSON vocabulary file, through the `tiktoken` package.

As Megatron-LM's TikTokenTokenizer (megatron/core/tokenizers/text/libraries/tiktoken_tokenizer.py, the
successor of megatron/training/tokenizer/tokenizer.py's CustomTikTokenizer):

- `--tokenizer-model` is a JSON list of {"rank": i, "token_bytes": base64, "token_str": text}, rank i at
  index i, the first 256 entries the single bytes 0..255;
- ids 0 .. N-1 are special tokens, N = --tiktoken-num-special-tokens (1000): the list of
  --tokenizer-special-tokens (default <unk> <s> </s> <mask> <pad> <cls> <sep>), then <SPECIAL_k> fillers;
  the file's rank r is id r + N;
- the vocabulary is --vocab-size ids (default 2**17 = 131072): the file's first --vocab-size - N entries
  (the file must hold that many);
- text splits by the v1 or v2 pattern (--tiktoken-pattern, default v2); special tokens written in the text
  are encoded as their ids (tiktoken's allowed_special="all"); eod is </s>; decoding joins the bytes
  of all ids (special tokens as their text).
"""
from __future__ import annotations

import base64
import json
import os
from typing import Dict, List, Optional

from .errors import DataError

PATTERN_V1 = r"[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+"
PATTERN_V2 = ("[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]*[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]+|"
              "[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]+[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]*|\\p{N}| ?"
              "[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+")
PATTERNS = {"v1": PATTERN_V1, "v2": PATTERN_V2}
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<mask>", "<pad>", "<cls>", "<sep>"]
DEFAULT_VOCAB_SIZE = 2 ** 17


def _import_tiktoken():
    try:
        import tiktoken
    except ImportError:
        raise DataError("--tokenizer-type TikTokenizer needs the tiktoken package, which is not installed; "
                        "pip install tiktoken (or megatron_zero[tiktoken])") from None
    return tiktoken


def read_ranks(path: str, max_vocab: int) -> Dict[bytes, int]:
    """The file's first `max_vocab` tokens -> their ranks (Megatron's reload_mergeable_ranks, unshifted)."""
    flag = f"--tokenizer-model {path}"
    if not os.path.isfile(path) or not path.endswith(".json"):
        raise DataError(f"{flag} is not a tiktoken vocabulary .json file (a list of rank, token_bytes, token_str).")
    try:
        with open(path, encoding="utf-8") as f:
            vocab = json.load(f)
    except (OSError, ValueError) as e:
        raise DataError(f"{flag} is not readable JSON ({e}).") from None
    if not isinstance(vocab, list):
        raise DataError(f"{flag} must hold a JSON list of {{rank, token_bytes, token_str}} entries.")
    ranks: Dict[bytes, int] = {}
    for i, entry in enumerate(vocab[:max_vocab]):
        if not isinstance(entry, dict) or set(entry) != {"rank", "token_bytes", "token_str"} or entry["rank"] != i:
            raise DataError(f"{flag}: entry {i} must be {{\"rank\": {i}, \"token_bytes\": ..., \"token_str\": ...}}.")
        token = base64.b64decode(entry["token_bytes"])
        if i < 256 and token != bytes([i]):
            raise DataError(f"{flag}: entry {i} must be the single byte {i} (the first 256 ranks are the bytes).")
        if token in ranks:
            raise DataError(f"{flag}: entry {i} repeats the token of entry {ranks[token]}.")
        ranks[token] = i
    return ranks


class TikTokenizer:
    """vocab_size, eod, tokenize(text) -> ids, detokenize(ids) -> text; `encoding` is the tiktoken.Encoding."""

    def __init__(self, path: str, pattern: Optional[str] = None, vocab_size: Optional[int] = None,
                 num_special_tokens: int = 1000, special_tokens: Optional[List[str]] = None):
        tiktoken = _import_tiktoken()
        pattern = pattern or "v2"
        if pattern not in PATTERNS:
            raise DataError(f"--tiktoken-pattern {pattern} is not v1 or v2.")
        vocab_size = DEFAULT_VOCAB_SIZE if vocab_size is None else int(vocab_size)
        names = list(SPECIAL_TOKENS if special_tokens is None else special_tokens)
        if len(set(names)) != len(names) or not set(SPECIAL_TOKENS) <= set(names):
            raise DataError(f"--tokenizer-special-tokens {' '.join(names)} must be distinct and include "
                            f"{' '.join(SPECIAL_TOKENS)}.")
        if not len(names) <= num_special_tokens < vocab_size:
            raise DataError(f"--tiktoken-num-special-tokens {num_special_tokens} must be at least the {len(names)} "
                            f"special tokens and below --vocab-size {vocab_size}.")
        names += [f"<SPECIAL_{i}>" for i in range(len(names), num_special_tokens)]
        inner = vocab_size - num_special_tokens
        ranks = read_ranks(path, inner)
        if len(ranks) < inner:
            raise DataError(f"--tokenizer-model {path} holds {len(ranks)} tokens, fewer than --vocab-size {vocab_size} "
                            f"minus {num_special_tokens} special tokens; give --vocab-size "
                            f"{len(ranks) + num_special_tokens} (or less).")
        self.special_tokens = names
        self.num_special_tokens = num_special_tokens
        self.vocab_size = vocab_size
        self.eod = names.index("</s>")
        self.bos, self.unk = names.index("<s>"), names.index("<unk>")
        self.encoding = tiktoken.Encoding(name=os.path.basename(os.path.dirname(os.path.abspath(path))),
                                          pat_str=PATTERNS[pattern],
                                          mergeable_ranks={t: r + num_special_tokens for t, r in ranks.items()},
                                          special_tokens={t: i for i, t in enumerate(names)})

    def tokenize(self, text: str) -> List[int]:
        return self.encoding.encode(text, allowed_special="all")

    def detokenize(self, ids) -> str:
        return self.encoding.decode([int(i) for i in ids])
