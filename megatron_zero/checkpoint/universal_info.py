"""How each parameter is merged into (and split from) its universal form.

A parameter is either split across TP ranks on one dimension (`cat_dim`), or
replicated across TP ranks (no `cat_dim`: DeepSpeed writes none for those), and may
hold the vocabulary on dim 0 (padded rows are cut to `original_vocab_size`).

For every name our GPT has, the rule comes from its layer type (model/params.py),
whatever the source TP is: row-parallel weights are cat_dim 1 even from a TP=1 source
(DeepSpeed would mark them 0 there, and a TP=2 target would then slice the wrong
dimension). For any other name, DeepSpeed's pattern lists in the checkpoint's
`universal_checkpoint_info` decide, exactly as deepspeed.checkpoint.ds_to_universal does.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

from ..model.params import BLOCK_PARAMS, POSITION_EMBEDDINGS, WORD_EMBEDDINGS

UNIVERSAL_CHECKPOINT_INFO = "universal_checkpoint_info"
UNIVERSAL_CHECKPOINT_VERSION = 0.2
VOCAB_PATTERNS = "vocabulary_parameter_patterns"
PIPELINE_REPLICATED_PATTERNS = "pipeline_replicated_parameter_patterns"
TP_REPLICATED_PATTERNS = "tp_replicated_parameter_patterns"
ROW_PARALLEL_PATTERNS = "parameter_with_row_parallelism_patterns"
TO_AVERAGE_PATTERNS = "parameter_to_average_patterns"
STATE_KEYS = ("fp32", "exp_avg", "exp_avg_sq")


@dataclass(frozen=True)
class MergeRule:
    cat_dim: Optional[int]   # None: replicated across TP ranks
    vocab: bool = False      # dim 0 is the (padded) vocabulary
    average: bool = False    # DeepSpeed's parameter_to_average_patterns


def _block_patterns(dim_test) -> list:
    return [r"\d+\." + re.escape(s) + "$" for s, (dim, _) in BLOCK_PARAMS.items() if dim_test(dim)]


def gpt_universal_checkpoint_info(original_vocab_size: int, padded_vocab_size: int) -> dict:
    """The `universal_checkpoint_info` our checkpoints carry (Megatron-DeepSpeed's keys and patterns)."""
    return {
        "universal_checkpoint_version": UNIVERSAL_CHECKPOINT_VERSION,
        "original_vocab_size": int(original_vocab_size),
        "padded_vocab_size": int(padded_vocab_size),
        VOCAB_PATTERNS: [re.escape(WORD_EMBEDDINGS) + "$"],
        PIPELINE_REPLICATED_PATTERNS: [re.escape(WORD_EMBEDDINGS) + "$", re.escape(POSITION_EMBEDDINGS) + "$"],
        TP_REPLICATED_PATTERNS: [re.escape(POSITION_EMBEDDINGS) + "$"] + _block_patterns(lambda d: d is None)
        + [r"\d+\.weight$", r"\d+\.bias$"],
        ROW_PARALLEL_PATTERNS: _block_patterns(lambda d: d == 1),
    }


def gpt_rule(name: str) -> Optional[MergeRule]:
    """The rule for one of our GPT's parameter names, or None for a name our GPT does not have."""
    if name == WORD_EMBEDDINGS:
        return MergeRule(0, vocab=True)
    if name == POSITION_EMBEDDINGS:
        return MergeRule(None)
    index, _, suffix = name.partition(".")
    if index.isdigit():
        if suffix in BLOCK_PARAMS:
            return MergeRule(BLOCK_PARAMS[suffix][0])
        if suffix in ("weight", "bias"):
            return MergeRule(None)  # the final LayerNorm
    return None


def _matches(patterns, name: str) -> bool:
    return any(re.match(p, name) for p in patterns or ())


def pattern_rule(name: str, info: Optional[dict]) -> MergeRule:
    """DeepSpeed's rule for a name from the checkpoint's pattern lists."""
    info = info or {}
    vocab = _matches(info.get(VOCAB_PATTERNS), name)
    if _matches(info.get(TP_REPLICATED_PATTERNS), name):
        return MergeRule(None, vocab)
    if _matches(info.get(TO_AVERAGE_PATTERNS), name):
        return MergeRule(None, vocab, average=True)
    return MergeRule(1 if _matches(info.get(ROW_PARALLEL_PATTERNS), name) else 0, vocab)


def merge_rule(name: str, info: Optional[dict]) -> MergeRule:
    return gpt_rule(name) or pattern_rule(name, info)


def is_pipeline_replicated(name: str, info: Optional[dict]) -> bool:
    return _matches((info or {}).get(PIPELINE_REPLICATED_PATTERNS), name)
