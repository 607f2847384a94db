"""The data flags (datasets, split, tokenizer): the tokenizer's default and --data-path's form."""
from __future__ import annotations

import argparse
from typing import List, Optional

from .errors import require
from .fields import add_section_flags, flag, section


@section("data")
class DataConfig:
    """The datasets, their split and the tokenizer, checked."""
    data_path: Optional[List[str]] = flag(
        "Megatron .bin/.idx dataset prefixes, optionally with weights (weight prefix weight prefix ...); none: a mock "
        "dataset", nargs="*")
    split: str = flag("train,validation,test proportions of the documents", "969,30,1")
    data_cache_path: Optional[str] = flag("where the dataset's sample index files are cached (default: beside the "
                                          "data)")
    # set by the check where not given
    tokenizer_type: Optional[str] = flag("default: GPT2BPETokenizer with --vocab-file and --merge-file (as "
                                         "Megatron-LM), else SentencePieceTokenizer")
    tokenizer_model: Optional[str] = flag("SentencePiece, TikTokenizer or Hugging Face tokenizer model file or "
                                          "directory")
    vocab_file: Optional[str] = flag("GPT-2 BPE vocabulary (vocab.json)")
    merge_file: Optional[str] = flag("GPT-2 BPE merges (merges.txt)")
    vocab_size: Optional[int] = flag("NullTokenizer's vocabulary; TikTokenizer's (default 131072, special tokens "
                                     "included)")
    tiktoken_pattern: Optional[str] = flag("TikTokenizer's split pattern (default v2, as Megatron-LM); other "
                                           "tokenizers have none, and ignore it as Megatron-LM does",
                                           choices=["v1", "v2"])
    tiktoken_num_special_tokens: int = flag("TikTokenizer: ids below this are special tokens; the vocabulary file's "
                                            "ranks follow", 1000)
    tokenizer_special_tokens: Optional[List[str]] = flag(
        "TikTokenizer's named special tokens (ids 0, 1, ...; must include <unk> <s> </s> <mask> <pad> <cls> <sep>), "
        "then <SPECIAL_k> fillers", nargs="+")


def add_flags(p: argparse.ArgumentParser) -> None:
    add_section_flags(p, DataConfig)


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
