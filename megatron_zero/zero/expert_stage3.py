"""ZeRO stage 3 with expert parallelism: dense parameters partitioned over the data-parallel group, expert
parameters (marked `expert_parallel`, moe/layer.py) over the expert-data-parallel group.

Two Stage3 instances behind the ZeroStage interface, as expert_stage.py pairs two Stage12: the optimizer's
param groups are the dense groups, then the expert groups. Each half hooks the units that hold its
parameters (an MoE block: both), gathers them over its own group around forward and backward, prefetches
along its own trace of units, and reduce-scatters their gradients over its own group: an expert's
gradient sums, over expert-DP, the loss of every DP rank whose tokens reached it, and the optimizer's one
factor 1 / (loss scale x DP) (`reduce_dp`, the full data-parallel size) averages it as it does the dense
gradients (Megatron-Core's expert gradient scaling). The global norm sums each rank's owned elements over
DP: experts differ across expert-parallel ranks and are partitioned within expert-DP, so every expert
element counts once.

The halves' saved-tensor hooks nest (a block's forward enters both; autograd calls the innermost), so they
share one map of gathered storage -> parameter, and a parameter saved for backward is re-gathered by the
half that partitions it (`p.ds_owner`). ZeRO++ (quantized gathers and reduce-scatters, hpZ) runs without
experts only (config/moe.py refuses it with EP).
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import List

import torch

from .expert_halves import ExpertHalves
from .partition import fragment_address
from .stage3 import Stage3


class ExpertParallelStage3(ExpertHalves):
    def __init__(self, dense_groups, expert_groups, dp_group, expert_dp_group, dtype: torch.dtype, bucket_size: int,
                 module, device: torch.device, layers=None, prefetch: bool = True,
                 persistence_threshold: int = 100_000, fp8_gather=None, expert_fp8_gather=None,
                 grads_to_host: bool = False):
        def stage(fp8_gather):
            """Stage3, or with --fp8-param-gather's gather of the half's FP8 layers Stage3Float8 (chunks in FP8)."""
            if fp8_gather is None:
                return Stage3, {}
            from .stage3_fp8 import Stage3Float8
            return Stage3Float8, {"fp8_gather": fp8_gather}

        cls, extra = stage(fp8_gather)
        dense = cls(dense_groups, dp_group, dtype, bucket_size, module=module, layers=layers,
                    prefetch=prefetch, persistence_threshold=persistence_threshold, device=device,
                    grads_to_host=grads_to_host, **extra)
        cls, extra = stage(expert_fp8_gather)
        expert = cls(expert_groups, expert_dp_group, dtype, bucket_size, module=module, layers=layers,
                     prefetch=prefetch, persistence_threshold=persistence_threshold, device=device,
                     storage_map=dense._storage, grads_to_host=grads_to_host, **extra)
        self._init_halves(dense, expert, len(dense_groups))
        self.dp, self.reduce_dp, self.rank = self.dense.dp, self.dense.dp, self.dense.rank
        self.grads_on_host = grads_to_host

    @property
    def halves(self):
        return self.dense, self.expert

    def slice_mappings(self, names):
        """Per group: name -> fragment_address(numel, start) of this rank's real elements in its flat group (the
        expert groups' chunks are cut over expert-DP, so a reader cannot rebuild them from the shapes alone)."""
        out = []
        for gi, group_names in enumerate(names):
            stage, i = self._pick(gi)
            frags = {id(p): fragment_address(numel=n, start=in_part) for p, _, in_part, n in stage.owned_ranges(i)}
            params = stage.groups[i]
            out.append({name: frags[id(p)] for name, p in zip(group_names, params) if id(p) in frags})
        return out

    def group_partition_counts(self) -> List[int]:
        """Per group: the ranks its optimizer state is partitioned over (DP, then expert-DP)."""
        return [self.dense.dp] * self.n_dense + [self.expert.dp] * len(self.expert.groups)

    @contextmanager
    def gathered(self):
        with self.dense.gathered(), self.expert.gathered():
            yield

    @property
    def peak_param_numel(self) -> int:
        return self.dense.peak_param_numel + self.expert.peak_param_numel

    @property
    def comm_bytes(self) -> dict:
        return {k: self.dense.comm_bytes[k] + self.expert.comm_bytes[k] for k in self.dense.comm_bytes}
