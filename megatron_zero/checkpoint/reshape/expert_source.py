"""The experts of an MoE checkpoint, named for reshaping: every expert of every rank, under its global id.

With expert parallelism a model-states file's `param_shapes` lists the experts of the rank that wrote
it (DP rank 0: EP rank 0's experts); the other EP ranks' experts sit in the same optimizer group index
of their own ZeRO files (zero/expert_stage.py: dense groups, then expert groups, partitioned over the
expert-data-parallel group). `all_expert_shapes` adds, beside each listed expert parameter, the same
parameter of every other expert the checkpoint's DeepSpeed-MoE files name (all experts of a layer have
one shape), so a StageReader finds each expert's fragments in the ZeRO files of the DP ranks holding it.
A checkpoint saved at an expert-tensor-parallel size other than TP (its args' `expert_tensor_parallel_size`)
holds each expert in ETP slices, slice e on the ranks of expert-TP rank e (distributed/topology.py's expert carving):
the StageReader merges an expert's slices by ETP, each gathered from its expert-DP group's files.

DeepSpeed's engine itself (Megatron-DeepSpeed's MoE runs) names an expert in a rank's ZeRO files by its
local id, the one its module has on that EP rank (`deepspeed_experts.{j}`, j < E / EP), while the
`layer_*_expert_*` files and ours use global ids: `LocalExpertNames` maps a global name to the name it has
in DP rank d's files (EP rank d % EP, DeepSpeed's expert-parallel groups of consecutive ranks), or to
nothing on a rank of another EP rank.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Dict, Iterable, List

import torch

from ...model.params import parse_expert_suffix, with_expert
from ..errors import CheckpointError
from ..format import EXPERT_FILE


def expert_ids(files: Iterable[str]) -> List[int]:
    """The global expert ids the checkpoint's `layer_*_expert_*` files name."""
    return sorted({int(m.group(2)) for m in map(EXPERT_FILE.match, files) if m})


def expert_of(name: str):
    index, _, suffix = name.partition(".")
    parsed = parse_expert_suffix(suffix) if index.isdigit() else None
    return None if parsed is None else (index, parsed[0], parsed[1])


def all_expert_shapes(groups: List["OrderedDict[str, torch.Size]"], ids: List[int], where: str
                      ) -> List["OrderedDict[str, torch.Size]"]:
    """`groups` (one file's param_shapes, our names) with every expert in `ids` beside the listed ones."""
    listed = {e for g in groups for n in g for e in [expert_of(n)] if e is not None}
    if not listed:
        return groups
    missing = sorted({e for _, e, _ in listed} - set(ids))
    if missing:
        raise CheckpointError(f"{where} lists experts {missing} that no layer_*_expert_* file of the checkpoint holds; "
                              "the checkpoint is incomplete")
    out = []
    for g in groups:
        expanded: "OrderedDict[str, torch.Size]" = OrderedDict(g)
        for name, shape in g.items():
            parsed = expert_of(name)
            if parsed is not None:
                for e in ids:
                    expanded.setdefault(with_expert(name, e), shape)
        out.append(expanded)
    return out


def partition_counts(osd: Dict) -> List[int]:
    """Per optimizer group, the ranks its state is partitioned over (1: every rank holds it whole)."""
    count = osd.get("partition_count", 1)
    return list(count) if isinstance(count, (list, tuple)) else [count]


class LocalExpertNames:
    """Global expert names -> their local names in one DP rank's ZeRO files (DeepSpeed engine's naming)."""

    def __init__(self, num_experts: int, ep: int, where: str):
        if ep < 1 or num_experts % ep:
            raise CheckpointError(f"{where} records {num_experts} experts over an expert-parallel size of {ep}, "
                                  "which does not divide them")
        self.ep, self.per_rank = ep, num_experts // ep

    def on_rank(self, name: str, dp: int):
        """`name` as DP rank dp's files name it, or None when that rank holds another EP rank's experts."""
        parsed = expert_of(name)
        if parsed is None:
            return name
        expert = parsed[1]
        if expert // self.per_rank != dp % self.ep:
            return None
        return with_expert(name, expert % self.per_rank)
