"""GPT-2 byte-level BPE from a `vocab.json` + `merges.txt` pair (Megatron's GPT2BPETokenizer).

The standard algorithm: split text with GPT-2's pre-tokenizer pattern, map each
piece's UTF-8 bytes to printable characters (`bytes_to_unicode`), then merge
adjacent symbols by merge rank until no ranked pair remains.

GPT-2's pattern uses `\\p{L}` (letters) and `\\p{N}` (numbers), which Python's `re`
lacks. We rebuild them exactly from Unicode categories: `\\p{L}` is `\\w` minus
`\\d`, `_` and the non-decimal numbers (categories No/Nl, e.g. '²', '½', 'Ⅻ');
`\\p{N}` is `\\d` plus those. Checked against the `regex` package: identical splits for every
code point assigned in Python's Unicode database, so no `regex` dependency is needed.
"""
from __future__ import annotations

import functools
import json
import re
import sys
import unicodedata
from typing import Dict, List, Tuple

from .errors import DataError


@functools.lru_cache(maxsize=None)
def bytes_to_unicode() -> Dict[int, str]:
    """Byte -> printable char; printable Latin-1 bytes map to themselves, the rest to 256+."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, n = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + n)
            n += 1
    return chars


def _char_class(codepoints: List[int]) -> str:
    out, i = [], 0
    while i < len(codepoints):
        j = i
        while j + 1 < len(codepoints) and codepoints[j + 1] == codepoints[j] + 1:
            j += 1
        a, b = re.escape(chr(codepoints[i])), re.escape(chr(codepoints[j]))
        out.append(a if i == j else f"{a}-{b}")
        i = j + 1
    return "".join(out)


@functools.lru_cache(maxsize=None)
def pretokenize_pattern() -> "re.Pattern":
    non_decimal_numbers, word_not_letter_or_number = [], []
    for cp in range(sys.maxunicode + 1):
        c = chr(cp)
        cat = unicodedata.category(c)
        if cat[0] == "N" and not c.isdecimal():
            non_decimal_numbers.append(cp)
        elif cat[0] not in "LN" and (c.isalnum() or c == "_"):
            word_not_letter_or_number.append(cp)
    nn, wx = _char_class(non_decimal_numbers), _char_class(word_not_letter_or_number)
    letter = rf"[^\W\d{nn}{wx}]"
    number = rf"[\d{nn}]"
    # Python's \s also matches \x1c-\x1f, which are not whitespace to `regex`.
    space, nonspace = r"[^\S\x1c-\x1f]", r"[\S\x1c-\x1f]"
    other = rf"(?:[^\s\w]|[\x1c-\x1f{wx}])"
    return re.compile(rf"'s|'t|'re|'ve|'m|'ll|'d| ?{letter}+| ?{number}+| ?{other}+|{space}+(?!{nonspace})|{space}+")


class GPT2BPETokenizer:
    """Byte-level BPE; `eod` is the id of `<|endoftext|>`, as in Megatron."""

    def __init__(self, vocab_file: str, merge_file: str):
        try:
            with open(vocab_file, encoding="utf-8") as f:
                self.encoder: Dict[str, int] = json.load(f)
        except (OSError, ValueError) as e:
            raise DataError(f"{vocab_file} is not a readable GPT-2 vocab.json ({e}).") from None
        self.decoder = {v: k for k, v in self.encoder.items()}
        with open(merge_file, encoding="utf-8") as f:
            lines = [ln.rstrip("\n") for ln in f]
        merges: List[Tuple[str, str]] = []
        for n, ln in enumerate(lines, 1):
            if not ln or ln.startswith("#version"):
                continue
            parts = ln.split()
            if len(parts) != 2:
                raise DataError(f"{merge_file} line {n} is not a merge of two symbols: {ln!r}.")
            merges.append((parts[0], parts[1]))
        self.ranks = {m: i for i, m in enumerate(merges)}
        self.byte_encoder = bytes_to_unicode()
        self.byte_decoder = {v: k for k, v in self.byte_encoder.items()}
        self.pattern = pretokenize_pattern()
        if "<|endoftext|>" not in self.encoder:
            raise DataError(f"{vocab_file} has no '<|endoftext|>' entry, which GPT-2 BPE uses as end of document.")
        self.eod = self.encoder["<|endoftext|>"]
        self._cache: Dict[str, List[str]] = {}

    @property
    def vocab_size(self) -> int:
        return len(self.encoder)

    def bpe(self, piece: str) -> List[str]:
        if piece in self._cache:
            return self._cache[piece]
        word = list(piece)
        while len(word) > 1:
            pairs = [(self.ranks.get((a, b), float("inf")), i) for i, (a, b) in enumerate(zip(word, word[1:]))]
            rank, _ = min(pairs)
            if rank == float("inf"):
                break
            a, b = next((word[i], word[i + 1]) for r, i in pairs if r == rank)
            merged, i = [], 0
            while i < len(word):
                if i + 1 < len(word) and word[i] == a and word[i + 1] == b:
                    merged.append(a + b)
                    i += 2
                else:
                    merged.append(word[i])
                    i += 1
            word = merged
        if len(self._cache) < 100_000:
            self._cache[piece] = word
        return word

    def tokenize(self, text: str) -> List[int]:
        ids: List[int] = []
        for piece in self.pattern.findall(text):
            mapped = "".join(self.byte_encoder[b] for b in piece.encode("utf-8"))
            ids.extend(self.encoder[s] for s in self.bpe(mapped))
        return ids

    def detokenize(self, ids) -> str:
        text = "".join(self.decoder[int(i)] for i in ids)
        return bytearray(self.byte_decoder[c] for c in text).decode("utf-8", errors="replace")
