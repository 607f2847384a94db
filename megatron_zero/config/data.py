"""The data flags (datasets, split, tokenizer): the tokenizer's default and --data-path's form."""
from __future__ import annotations

import argparse
from typing import List

from .errors import require


def add_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("data")
    g.add_argument("--data-path", nargs="*", default=None,
                   help="Megatron .bin/.idx dataset prefixes, optionally with weights (weight prefix weight prefix ...); none: a mock "
                        "dataset")
    g.add_argument("--split", type=str, default="969,30,1",
                   help="train,validation,test proportions of the documents")
    g.add_argument("--data-cache-path", type=str, default=None,
                   help="where the dataset's sample index files are cached (default: beside the data)")
    g.add_argument("--tokenizer-type", type=str, default=None,
                   help="default: GPT2BPETokenizer with --vocab-file and --merge-file (as Megatron-LM), else "
                        "SentencePieceTokenizer")
    g.add_argument("--tokenizer-model", type=str, default=None,
                   help="SentencePiece, TikTokenizer or Hugging Face tokenizer model file or directory")
    g.add_argument("--vocab-file", type=str, default=None,
                   help="GPT-2 BPE vocabulary (vocab.json)")
    g.add_argument("--merge-file", type=str, default=None,
                   help="GPT-2 BPE merges (merges.txt)")
    g.add_argument("--vocab-size", type=int, default=None,
                   help="NullTokenizer's vocabulary; TikTokenizer's (default 131072, special tokens included)")
    g.add_argument("--tiktoken-pattern", choices=["v1", "v2"], default=None,
                   help="TikTokenizer's split pattern (default v2, as Megatron-LM); other tokenizers have none, "
                        "and ignore it as Megatron-LM does")
    g.add_argument("--tiktoken-num-special-tokens", type=int, default=1000,
                   help="TikTokenizer: ids below this are special tokens; the vocabulary file's ranks follow")
    g.add_argument("--tokenizer-special-tokens", nargs="+", default=None,
                   help="TikTokenizer's named special tokens (ids 0, 1, ...; must include <unk> <s> </s> <mask> "
                        "<pad> <cls> <sep>), then <SPECIAL_k> fillers")


def check(args) -> None:
    if args.tokenizer_type is None:
        args.tokenizer_type = "GPT2BPETokenizer" if args.vocab_file and args.merge_file else "SentencePieceTokenizer"
    if args.data_path:
        _check_data_path(args.data_path)


def _check_data_path(data_path: List[str]) -> None:
    """--data-path is either one or more prefixes, or weight/prefix pairs."""
    if len(data_path) == 1 or not _is_number(data_path[0]):
        return
    require(len(data_path) % 2 == 0, f"--data-path with weights needs weight/prefix pairs, got {len(data_path)} values")
    for weight in data_path[0::2]:
        require(_is_number(weight) and float(weight) > 0, f"--data-path weight {weight!r} is not a positive number")


def _is_number(text: str) -> bool:
    try:
        float(text)
        return True
    except ValueError:
        return False
