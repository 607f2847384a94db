#!/usr/bin/env python
"""Build the built-in corpus (Python's pydoc topics): JSONL, a SentencePiece model, an indexed dataset.

    python tools/build_corpus.py --output-dir data/builtin

Prints shell assignments on stdout, e.g. `eval "$(python tools/build_corpus.py)"`:
DATA_PATH=..., TOKENIZER_MODEL=..., TOKENIZER_TYPE=..., VOCAB_SIZE=...
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_zero.data.corpus import TOKENIZER_TYPE, build_corpus  # noqa: E402
from megatron_zero.data.errors import DataError  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--output-dir", default="data/builtin")
    p.add_argument("--vocab-size", type=int, default=2048)
    p.add_argument("--workers", type=int, default=1)
    a = p.parse_args(argv)
    try:
        out = build_corpus(a.output_dir, a.vocab_size, a.workers)
    except DataError as e:
        print(e, file=sys.stderr)
        return 2
    print(f"DATA_PATH={out['data_prefix']}")
    print(f"TOKENIZER_MODEL={out['tokenizer_model']}")
    print(f"TOKENIZER_TYPE={TOKENIZER_TYPE}")
    print(f"VOCAB_SIZE={a.vocab_size}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
