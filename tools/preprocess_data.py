#!/usr/bin/env python
"""Tokenize a JSONL corpus into Megatron's indexed dataset: {output_prefix}_{key}_document.bin/.idx.

    python tools/preprocess_data.py --input corpus.jsonl --output-prefix data/corpus \
        --tokenizer-type GPTSentencePieceTokenizer --tokenizer-model tok.model --append-eod --workers 2
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_zero.data.errors import DataError  # noqa: E402
from megatron_zero.data.preprocess import preprocess  # noqa: E402
from megatron_zero.data.tokenizers import TOKENIZER_TYPES  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--input", required=True, help="JSONL file, one document per line")
    p.add_argument("--json-keys", nargs="+", default=["text"], help="keys to extract (one dataset per key)")
    p.add_argument("--output-prefix", required=True)
    p.add_argument("--tokenizer-type", required=True, choices=TOKENIZER_TYPES)
    p.add_argument("--tokenizer-model", help="SentencePiece .model, HF tokenizer.json (or its directory), or "
                                             "TikTokenizer's vocabulary .json")
    p.add_argument("--vocab-file", help="GPT-2 vocab.json")
    p.add_argument("--merge-file", help="GPT-2 merges.txt")
    p.add_argument("--vocab-size", type=int, help="NullTokenizer vocabulary size; TikTokenizer's (default 131072)")
    p.add_argument("--tiktoken-pattern", choices=["v1", "v2"], default=None, help="TikTokenizer's split pattern (v2)")
    p.add_argument("--tiktoken-num-special-tokens", type=int, default=1000, help="TikTokenizer's special ids")
    p.add_argument("--tokenizer-special-tokens", nargs="+", default=None, help="TikTokenizer's named special tokens")
    p.add_argument("--append-eod", action="store_true", help="append the end-of-document token")
    p.add_argument("--workers", type=int, default=1, help="tokenizer processes")
    p.add_argument("--skip-bad-lines", action="store_true",
                   help="leave out malformed lines (counted) instead of stopping at the first")
    p.add_argument("--log-interval", type=float, default=1.0, help="seconds between progress lines")
    return p.parse_args(argv)


def main(argv=None) -> int:
    a = parse_args(argv)
    try:
        stats = preprocess(a.input, a.output_prefix, a.tokenizer_type, a.tokenizer_model, a.vocab_file,
                           a.merge_file, a.vocab_size, a.json_keys, a.append_eod, a.workers,
                           a.skip_bad_lines, a.log_interval,
                           tokenizer_options=dict(tiktoken_pattern=a.tiktoken_pattern,
                                                  tiktoken_num_special_tokens=a.tiktoken_num_special_tokens,
                                                  special_tokens=a.tokenizer_special_tokens))
    except DataError as e:
        print(e, file=sys.stderr)
        return 2
    for err in stats.skipped[:10]:
        print(f"skipped: {err}", file=sys.stderr)
    for prefix in stats.outputs:
        print(f"wrote {prefix}.bin and {prefix}.idx", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
