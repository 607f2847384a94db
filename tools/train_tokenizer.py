#!/usr/bin/env python
"""Train a SentencePiece tokenizer from text or JSONL files (deterministic).

    python tools/train_tokenizer.py --input corpus.jsonl --model-prefix data/tok --vocab-size 2048
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_zero.data.errors import DataError  # noqa: E402
from megatron_zero.data.tokenizer_training import iter_texts, train_sentencepiece  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--input", nargs="+", required=True, help=".jsonl/.json (by --json-keys) or plain text files")
    p.add_argument("--json-keys", nargs="+", default=["text"])
    p.add_argument("--model-prefix", required=True, help="writes {prefix}.model and {prefix}.vocab")
    p.add_argument("--vocab-size", type=int, default=2048)
    p.add_argument("--model-type", default="bpe", choices=["bpe", "unigram", "char", "word"])
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--num-threads", type=int, default=1)
    a = p.parse_args(argv)
    try:
        path = train_sentencepiece(iter_texts(a.input, a.json_keys), a.model_prefix, a.vocab_size,
                                   a.model_type, a.seed, a.num_threads)
    except DataError as e:
        print(e, file=sys.stderr)
        return 2
    print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
