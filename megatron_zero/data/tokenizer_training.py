"""Train a SentencePiece model from text or JSONL files, deterministically."""
from __future__ import annotations

import os
from typing import Iterable, Iterator, Sequence

from .jsonl import iter_jsonl


def iter_texts(paths: Sequence[str], json_keys: Sequence[str] = ("text",)) -> Iterator[str]:
    """Documents from `.jsonl`/`.json` files (the given keys) and plain text files (each line)."""
    for p in paths:
        if p.endswith((".jsonl", ".json")):
            for _, doc in iter_jsonl(p, json_keys):
                yield from doc.values()
        else:
            with open(p, encoding="utf-8") as f:
                yield from (ln.rstrip("\n") for ln in f)


def train_sentencepiece(texts: Iterable[str], model_prefix: str, vocab_size: int = 2048,
                        model_type: str = "bpe", seed: int = 1234, num_threads: int = 1) -> str:
    """Train `{model_prefix}.model` (and `.vocab`); returns the `.model` path.

    Same input, same arguments -> byte-identical model: no input shuffling, a fixed
    random seed and thread count, and no output path recorded inside the model.
    Characters outside the vocabulary fall back to byte pieces. Files appear whole
    (written to a temporary name, then renamed).
    """
    import io

    import sentencepiece as spm

    spm.set_random_generator_seed(seed)
    os.makedirs(os.path.dirname(os.path.abspath(model_prefix)), exist_ok=True)
    lines = (ln for t in texts for ln in t.split("\n") if ln.strip())
    proto = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=lines, model_writer=proto, vocab_size=vocab_size,
        model_type=model_type, character_coverage=1.0, byte_fallback=True,
        shuffle_input_sentence=False, num_threads=num_threads, max_sentence_length=1 << 16,
        unk_id=0, bos_id=1, eos_id=2, pad_id=-1, minloglevel=2)
    sp = spm.SentencePieceProcessor(model_proto=proto.getvalue())
    vocab = "".join(f"{sp.id_to_piece(i)}\t{sp.get_score(i):g}\n" for i in range(sp.get_piece_size()))
    for ext, data in ((".vocab", vocab.encode("utf-8")), (".model", proto.getvalue())):
        tmp = f"{model_prefix}{ext}.{os.getpid()}.tmp"
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, model_prefix + ext)
    return model_prefix + ".model"
