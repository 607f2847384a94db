"""ZeRO 0/1/2 with expert parallelism: dense parameters over the data-parallel group, expert parameters
(marked `expert_parallel`, moe/layer.py) over the expert-data-parallel group.

Two Stage12 instances behind the ZeroStage interface: the optimizer's param groups are the dense
groups, then the expert groups (Megatron-Core's separate expert buckets and optimizer shards). An
expert's gradient, reduce-scattered over its expert-DP group, sums the loss of every DP rank whose
tokens reached it, so the optimizer's one factor 1 / (loss scale x DP) (the full data-parallel size,
`reduce_dp` below: DP x CP with context parallelism, whose ranks' losses are scaled by CP) averages it
as it does the dense gradients (Megatron-Core's expert gradient scaling). Summed over the DP group,
every expert element of the global norm counts once: experts differ across the expert-parallel ranks and
are partitioned within the expert-DP group. At stage 0 every rank holds whole gradients (dense:
all-reduced over DP; experts: over expert-DP), so the norm is still summed over DP with each replica counted
once: dense groups on DP rank 0, expert groups on expert-DP rank 0 (`counts_in_norm_here`).

With `overlap_grad_reduce` / `overlap_param_gather` both halves are Stage12Overlap (stage12_overlap.py):
each launches its buckets' reduce-scatters async on its own group (dense over DP, expert over
expert-DP) as backward completes them, and after the step all-gathers its partitions async over that
group, each unit's forward waiting for the chunks of both halves it uses (Megatron-Core's expert
buckets and expert-DP param gather).
"""
from __future__ import annotations

from typing import List, Sequence, Tuple

import torch
import torch.distributed as dist

from .expert_halves import ExpertHalves
from .stage12 import Stage12
from .stage12_overlap import Stage12Overlap


def split_expert_groups(named_groups, hparams):
    """(dense groups, their hparams, expert groups, their hparams), empty expert groups dropped."""
    dense, expert, expert_hp = [], [], []
    for group, hp in zip(named_groups, hparams):
        dense.append([(n, p) for n, p in group if not getattr(p, "expert_parallel", False)])
        mine = [(n, p) for n, p in group if getattr(p, "expert_parallel", False)]
        if mine:
            expert.append(mine)
            expert_hp.append(hp)
    return dense, list(hparams), expert, expert_hp


class ExpertParallelStage(ExpertHalves):
    def __init__(self, dense_groups: Sequence[Sequence[Tuple[str, torch.nn.Parameter]]], expert_groups,
                 dp_group, expert_dp_group, stage: int, dtype: torch.dtype, bucket_size: int,
                 device: torch.device, grad_reduce_dtype: torch.dtype = torch.float32,
                 overlap_grad_reduce: bool = False, overlap_param_gather: bool = False, module=None, fp8_gather=None,
                 expert_fp8_gather=None, grads_to_host: bool = False):
        """`fp8_gather`, `expert_fp8_gather` (--fp8-param-gather): the dense half gathers the dense FP8 layers'
        weights in FP8, the expert half the experts'."""
        if overlap_grad_reduce or overlap_param_gather:
            def half(groups, group, fp8=None):
                return Stage12Overlap(groups, group, stage, dtype, bucket_size, overlap_grad_reduce,
                                      overlap_param_gather, module=module, device=device,
                                      grad_reduce_dtype=grad_reduce_dtype, fp8_gather=fp8,
                                      grads_to_host=grads_to_host)
        else:
            def half(groups, group, fp8=None):
                return Stage12(groups, group, stage, dtype, bucket_size, device, grad_reduce_dtype=grad_reduce_dtype,
                               fp8_gather=fp8, grads_to_host=grads_to_host)
        self._init_halves(half(dense_groups, dp_group, fp8_gather),
                          half(expert_groups, expert_dp_group, expert_fp8_gather), len(dense_groups))
        self.overlapped = overlap_grad_reduce or overlap_param_gather
        self.norm_over_dp = stage == 0  # the optimizer sums the norm over DP (counts_in_norm_here)
        self._replica_rank = [dist.get_rank(g) if g is not None else 0 for g in (dp_group, expert_dp_group)]
        self.dp, self.reduce_dp, self.rank = self.dense.dp, self.dense.reduce_dp, self.dense.rank
        self.grads_on_host = grads_to_host

    def counts_in_norm_here(self, gi: int) -> bool:
        """Whether this rank's gradients of group `gi` count in the norm summed over DP: at stage 0 one
        replica each (DP rank 0 for dense groups, expert-DP rank 0 for expert groups); else all."""
        return not self.norm_over_dp or self._replica_rank[0 if gi < self.n_dense else 1] == 0
    # ---- overlap (both halves Stage12Overlap) ----------------------------------------------
    def arm(self, params=None) -> None:
        if self.overlapped:
            self.dense.arm(params)
            self.expert.arm(params)

    def wait_params(self) -> None:
        if self.overlapped:
            self.dense.wait_params()
            self.expert.wait_params()

    @property
    def _in_flight(self):
        """The bucket collectives under way on either group."""
        return list(self.dense.buckets._in_flight) + list(self.expert.buckets._in_flight)

    def slice_mappings(self, names=None):
        return self.dense.slice_mappings() + self.expert.slice_mappings()

    def group_partition_counts(self) -> List[int]:
        """Per group: the ranks its optimizer state is partitioned over (DP, then expert-DP)."""
        return [self.dense.dp] * self.n_dense + [self.expert.dp] * len(self.expert.parts)

    def group_paddings(self) -> List[int]:
        return self.dense.group_paddings() + self.expert.group_paddings()
