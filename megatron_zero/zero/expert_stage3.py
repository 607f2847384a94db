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
experts only (arguments.py refuses it with EP).
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import List

import torch

from .partition import fragment_address
from .stage3 import Stage3


class ExpertParallelStage3:
    def __init__(self, dense_groups, expert_groups, dp_group, expert_dp_group, dtype: torch.dtype, bucket_size: int,
                 module, device: torch.device, layers=None, prefetch: bool = True,
                 persistence_threshold: int = 100_000):
        self.dense = Stage3(dense_groups, dp_group, dtype, bucket_size, module=module, layers=layers,
                            prefetch=prefetch, persistence_threshold=persistence_threshold, device=device)
        self.expert = Stage3(expert_groups, expert_dp_group, dtype, bucket_size, module=module, layers=layers,
                             prefetch=prefetch, persistence_threshold=persistence_threshold, device=device,
                             storage_map=self.dense._storage)
        self.n_dense = len(dense_groups)
        self.dp, self.reduce_dp, self.rank = self.dense.dp, self.dense.dp, self.dense.rank
        self.initial_masters = self.dense.initial_masters + self.expert.initial_masters
        del self.dense.initial_masters, self.expert.initial_masters

    def _pick(self, gi: int):
        return (self.dense, gi) if gi < self.n_dense else (self.expert, gi - self.n_dense)

    @property
    def halves(self):
        return self.dense, self.expert

    def finish_backward(self) -> None:
        self.dense.finish_backward()
        self.expert.finish_backward()

    def grad_partitions(self) -> List[torch.Tensor]:
        return self.dense.grad_partitions() + self.expert.grad_partitions()

    def weight_slices(self) -> List[torch.Tensor]:
        return self.dense.weight_slices() + self.expert.weight_slices()

    def write_weights(self, masters: List[torch.Tensor]) -> None:
        self.dense.write_weights(masters[:self.n_dense])
        self.expert.write_weights(masters[self.n_dense:])

    def zero_grad(self) -> None:
        self.dense.zero_grad()
        self.expert.zero_grad()

    def owned_ranges(self, gi: int):
        stage, i = self._pick(gi)
        return stage.owned_ranges(i)

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

    def grad_bytes(self) -> int:
        return self.dense.grad_bytes() + self.expert.grad_bytes()

    def param_bytes(self) -> int:
        return self.dense.param_bytes() + self.expert.param_bytes()

    @property
    def peak_param_numel(self) -> int:
        return self.dense.peak_param_numel + self.expert.peak_param_numel

    @property
    def comm_bytes(self) -> dict:
        return {k: self.dense.comm_bytes[k] + self.expert.comm_bytes[k] for k in self.dense.comm_bytes}

    def remove_hooks(self) -> None:
        self.dense.remove_hooks()
        self.expert.remove_hooks()
