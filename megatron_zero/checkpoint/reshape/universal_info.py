"""How each parameter is merged into (and split from) its universal form.

A parameter is either split across TP ranks on one dimension (`cat_dim`), or
replicated across TP ranks (no `cat_dim`: DeepSpeed writes none for those), and may
hold the vocabulary on dim 0 (padded rows are cut to `original_vocab_size`).

For every name our GPT has, the rule comes from its layer type (model/params.py),
whatever the source TP is: row-parallel weights are cat_dim 1 even from a TP=1 source
(DeepSpeed would mark them 0 there, and a TP=2 target would then slice the wrong
dimension). For any other name, DeepSpeed's pattern lists in the checkpoint's
`universal_checkpoint_info` decide, exactly as deepspeed.checkpoint.ds_to_universal does.
A tensor of two sub-parameters (SwiGLU's [gate; up], DeepSpeed's
`parameter_with_2_sub_params_cat_dim_0`) is merged block by block: [gate_0..gate_n; up_0..up_n].
An MoE block's experts (`{i}.mlp.deepspeed_moe.experts.deepspeed_experts.{e}.*`, global ids) merge as the
dense MLP's parameters do, and so does its shared expert (`{i}.mlp.shared_expert.*`); its router
(`{i}.mlp.deepspeed_moe.gate.wg.weight`) and the shared expert's gate are TP-replicated. A multi-token
prediction depth (`{L+4}.{k}.*`) merges its block's parameters as a block's, eh_proj on dim 0, its norms replicated.

The pattern lists a checkpoint records for DeepSpeed's readers (`deepspeed_pattern_lists`: its ds_to_universal,
the zero_to_fp32.py copied into every checkpoint) come from the same catalogue: one pattern per parameter name,
its layer index, MTP depth and expert id generalised, so an MoE block's experts, router and shared expert, MLA's
projections and an MTP depth's are listed as what they are, and every pattern matches a parameter of the model
(ds_to_universal refuses a checkpoint whose info lists a pattern that none matches).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

from ...model.params import (BLOCK_PARAMS, LM_HEAD_SUFFIX, MOE_ROUTER_SUFFIX, MTP_LAYER_PREFIX, MTP_PROJECTION,
                            POSITION_EMBEDDINGS, SHARED_EXPERT_GATE_SUFFIX, SHARED_EXPERT_PREFIX,
                            UNTIED_POSITION_EMBEDDINGS, UNTIED_WORD_EMBEDDINGS, WORD_EMBEDDINGS, param_names, param_spec,
                            parse_expert_suffix, parse_mtp_suffix)
from ..format import ROW_PARALLEL_PATTERNS, SUB_PARAMS_PATTERNS, TO_AVERAGE_PATTERNS, TP_REPLICATED_PATTERNS, VOCAB_PATTERNS
_LM_HEAD = re.compile(r"\d+\." + re.escape(LM_HEAD_SUFFIX) + "$")


@dataclass(frozen=True)
class MergeRule:
    cat_dim: Optional[int]   # None: replicated across TP ranks
    vocab: bool = False      # dim 0 is the (padded) vocabulary
    average: bool = False    # DeepSpeed's parameter_to_average_patterns
    sub_params: int = 1      # >1: cat_dim holds this many equal blocks, each concatenated over TP on its own


def gpt_rule(name: str, info: Optional[dict], _listed_as: str = None) -> Optional[MergeRule]:
    """The rule for one of our GPT's parameter names, or None for a name our GPT does not have.

    Whether dense_h_to_4h holds SwiGLU's [gate; up] (two sub-parameters, each split across TP)
    is a property of the model, recorded in the checkpoint's pattern list SUB_PARAMS_PATTERNS: an expert's,
    the shared expert's or an MTP depth's is one where the list names it, or (the lists written before they
    named them) the dense MLP's parameter it stands for (`_listed_as`: the name the recursion started from)."""
    if name in (WORD_EMBEDDINGS, UNTIED_WORD_EMBEDDINGS) or _LM_HEAD.match(name):
        return MergeRule(0, vocab=True)
    if name in (POSITION_EMBEDDINGS, UNTIED_POSITION_EMBEDDINGS):
        return MergeRule(None)
    index, _, suffix = name.partition(".")
    if index.isdigit():
        if suffix in (MOE_ROUTER_SUFFIX, SHARED_EXPERT_GATE_SUFFIX):
            return MergeRule(None)  # the router and the shared expert's gate: replicated across TP ranks
        listed = _listed_as or name
        if suffix.startswith(SHARED_EXPERT_PREFIX):  # the shared expert: merged as the dense MLP's parameter
            return gpt_rule(f"{index}.mlp.{suffix[len(SHARED_EXPERT_PREFIX):]}", info, listed)
        expert = parse_expert_suffix(suffix)
        if expert is not None:  # an expert: merged as the dense MLP parameter it stands for
            return gpt_rule(f"{index}.{expert[1]}", info, listed)
        if suffix in BLOCK_PARAMS:
            swiglu = (info or {}).get(SUB_PARAMS_PATTERNS)
            sub_params = 2 if _matches(swiglu, name) or _matches(swiglu, listed) else 1
            return MergeRule(BLOCK_PARAMS[suffix][0], sub_params=sub_params)
        if suffix in ("weight", "bias"):
            return MergeRule(None)  # the final norm
        depth = parse_mtp_suffix(suffix)
        if depth is not None:  # a multi-token prediction depth's `{k}.<local>`
            local = depth[1]
            if local.startswith(MTP_LAYER_PREFIX):  # its block: merged as a block's parameter
                return gpt_rule(f"{index}.{local[len(MTP_LAYER_PREFIX):]}", info, listed)
            return MergeRule(0) if local == MTP_PROJECTION else MergeRule(None)  # eh_proj column-parallel; norms
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
    return gpt_rule(name, info) or pattern_rule(name, info)


def deepspeed_pattern_lists(config) -> dict:
    """DeepSpeed's pattern lists for this model's parameters (the catalogue's split of each, model/params.py):
    TP-replicated, row-parallel (dim 1) and SwiGLU's [gate; up] (two sub-parameters on dim 0, with --swiglu
    only); a name in none of them is split on dim 0. The vocabulary's and the pipeline's lists are the
    caller's (deepspeed_layout.universal_checkpoint_info)."""
    lists = {TP_REPLICATED_PATTERNS: [], ROW_PARALLEL_PATTERNS: [], SUB_PARAMS_PATTERNS: []}
    for name in param_names(config):
        spec = param_spec(name, config)
        if spec.is_vocab:
            continue
        key = (TP_REPLICATED_PATTERNS if spec.partition_dim is None else ROW_PARALLEL_PATTERNS if spec.partition_dim == 1
               else SUB_PARAMS_PATTERNS if spec.sub_params == 2 else None)
        pattern = name_pattern(name)
        if key is not None and pattern not in lists[key]:
            lists[key].append(pattern)
    if not config.swiglu:
        del lists[SUB_PARAMS_PATTERNS]
    return lists


def name_pattern(name: str) -> str:
    """The pattern of every parameter like `name`: its numbers (layer index, MTP depth, expert id) any number,
    the rest as written, to the end of the name."""
    return r"\.".join(r"\d+" if part.isdigit() else re.escape(part) for part in name.split(".")) + "$"
