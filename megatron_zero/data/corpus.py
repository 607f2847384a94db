"""The built-in corpus: Python's own documentation topics, on every machine, no download.

`pydoc_data.topics` ships with CPython (~0.5 MB of English prose about the language).
build_corpus() turns it into JSONL (one document per paragraph group), trains a
small SentencePiece model on it and preprocesses it into an indexed dataset:

    {out}/pydoc_topics.jsonl
    {out}/tokenizer.model                  GPTSentencePieceTokenizer (eod = eos id 2)
    {out}/pydoc_text_document.bin/.idx     the --data-path prefix is {out}/pydoc_text_document

Each step is skipped when its output exists and opens cleanly, so calling it again is cheap.
Same Python version, same arguments -> the same files.
"""
from __future__ import annotations

import json
import os
import sys
from typing import Dict, Iterator

from .errors import DataError
from .indexed_dataset import IndexedDataset
from .preprocess import preprocess
from .tokenizer_training import iter_texts, train_sentencepiece
from .tokenizers import GPTSentencePieceTokenizer

TOKENIZER_TYPE = "GPTSentencePieceTokenizer"


def topic_documents(max_chars: int = 4000) -> Iterator[Dict[str, str]]:
    """Each topic's paragraphs, grouped into documents of at most ~max_chars characters."""
    from pydoc_data.topics import topics

    for name in sorted(topics):
        doc = []
        for para in topics[name].split("\n\n"):
            if doc and sum(len(p) for p in doc) + len(para) > max_chars:
                yield {"text": "\n\n".join(doc), "topic": name}
                doc = []
            if para.strip():
                doc.append(para)
        if doc:
            yield {"text": "\n\n".join(doc), "topic": name}


def _write_jsonl(path: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        for d in topic_documents():
            f.write(json.dumps(d, ensure_ascii=False) + "\n")
    os.replace(tmp, path)


def _model_ok(path: str) -> bool:
    try:
        GPTSentencePieceTokenizer(path)
        return True
    except DataError:
        return False


def _dataset_ok(prefix: str) -> bool:
    try:
        return IndexedDataset(prefix).num_documents > 0
    except DataError:
        return False


def build_corpus(output_dir: str = "data/builtin", vocab_size: int = 2048, workers: int = 1,
                 log=sys.stderr) -> Dict[str, str]:
    """Build (or reuse) the built-in corpus; returns {'data_prefix', 'tokenizer_model', 'jsonl'}."""
    os.makedirs(output_dir, exist_ok=True)
    jsonl = os.path.join(output_dir, "pydoc_topics.jsonl")
    model = os.path.join(output_dir, "tokenizer.model")
    prefix = os.path.join(output_dir, "pydoc")
    data_prefix = prefix + "_text_document"
    if not os.path.isfile(jsonl):
        _write_jsonl(jsonl)
    if not _model_ok(model):
        train_sentencepiece(iter_texts([jsonl]), model[:-len(".model")], vocab_size=vocab_size)
    if not _dataset_ok(data_prefix):
        preprocess(jsonl, prefix, TOKENIZER_TYPE, tokenizer_model=model, append_eod=True, workers=workers, log=log)
    return {"data_prefix": data_prefix, "tokenizer_model": model, "jsonl": jsonl}
