"""A small tiktoken vocabulary trained here on corpus text, in Megatron-LM's JSON layout (no downloads).

    path = tiktoken_vocab("dir/vocab.json", texts, merges=120, extra=[b"xQ"])

Byte-level BPE over the text pre-split by the v2 pattern (as tiktoken splits it): ranks 0..255 are the
bytes, then each merge's token in merge order (the most frequent adjacent pair, ties broken by the bytes).
The file is a JSON list of {"rank", "token_bytes" (base64), "token_str"}, as --tokenizer-model of
--tokenizer-type TikTokenizer reads it.
"""
from __future__ import annotations

import base64
import json
from collections import Counter
from typing import Iterable, List


def train_ranks(texts: Iterable[str], merges: int, pattern: str) -> List[bytes]:
    import regex

    counts = Counter(piece.encode("utf-8") for text in texts for piece in regex.findall(pattern, text))
    words = {word: [bytes([b]) for b in word] for word in counts}
    vocab, known = [bytes([i]) for i in range(256)], {bytes([i]) for i in range(256)}
    for _ in range(merges):
        pairs = Counter()
        for word, parts in words.items():
            for a, b in zip(parts, parts[1:]):
                pairs[(a, b)] += counts[word]
        if not pairs:
            break
        (a, b), _ = max(pairs.items(), key=lambda kv: (kv[1], kv[0]))
        if a + b not in known:
            vocab.append(a + b)
            known.add(a + b)
        for word, parts in words.items():
            merged, i = [], 0
            while i < len(parts):
                if i + 1 < len(parts) and parts[i] == a and parts[i + 1] == b:
                    merged.append(a + b)
                    i += 2
                else:
                    merged.append(parts[i])
                    i += 1
            words[word] = merged
    return vocab


def tiktoken_vocab(path: str, texts: Iterable[str], merges: int = 120, extra: Iterable[bytes] = ()) -> str:
    """Write the vocabulary of `merges` merges trained on `texts`, then the `extra` tokens (last ranks)."""
    from ..data.tiktoken_tokenizer import PATTERN_V2

    vocab = train_ranks(texts, merges, PATTERN_V2)
    vocab += [t for t in extra if t not in vocab]
    entries = [{"rank": i, "token_bytes": base64.b64encode(t).decode("ascii"),
                "token_str": t.decode("utf-8", errors="replace")} for i, t in enumerate(vocab)]
    with open(path, "w", encoding="utf-8") as f:
        json.dump(entries, f)
    return path
