"""Small Hugging Face tokenizers trained here on the pydoc corpus text, for tests and benchmarks (no downloads).

    path = byte_level_bpe(directory, vocab_size=300)        # GPT-2 style: tokenizer.json, vocab.json, merges.txt
    path = byte_level_bpe(directory, 300, bos="<s>", eos="</s>")   # Llama style: <s> prepended by the tokenizer
"""
from __future__ import annotations

import json
import os
from typing import Optional


def corpus_texts(n: Optional[int] = None):
    import pydoc_data.topics

    return list(pydoc_data.topics.topics.values())[:n]


def byte_level_bpe(directory: str, vocab_size: int = 300, bos: Optional[str] = None,
                   eos: str = "<|endoftext|>", texts=None) -> str:
    """Train a byte-level BPE; write tokenizer.json (+ tokenizer_config.json naming eos, vocab.json, merges.txt)."""
    from tokenizers import ByteLevelBPETokenizer, processors

    os.makedirs(directory, exist_ok=True)
    tok = ByteLevelBPETokenizer()
    specials = [t for t in (bos, eos) if t]
    tok.train_from_iterator(texts or corpus_texts(20), vocab_size=vocab_size, special_tokens=specials,
                            show_progress=False)
    if bos:
        tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A",
                                                           special_tokens=[(bos, tok.token_to_id(bos))])
    tok.save(os.path.join(directory, "tokenizer.json"))
    tok.save_model(directory)
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": eos, **({"bos_token": bos} if bos else {})}, f)
    return os.path.join(directory, "tokenizer.json")
