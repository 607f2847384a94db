"""Every layout of a cluster that fits, ranked by predicted tokens/s.

Candidates: TP within a node (powers of two dividing the heads), PP dividing the layers, CP, EP dividing the
experts, ZeRO 0-3 (3 only without PP), full or no recomputation, micro-batch 1, 2, 4; DP is what remains
of the GPUs and must divide the global batch. Memory from memory.py (one fake build and trace per
distinct TP x PP x CP x EP x recompute x micro-batch), time from time_model.py.
"""
from __future__ import annotations

import dataclasses
import itertools
from typing import Iterator, List, Tuple

from .memory import GIB, Plan, RankMemory, rank_memory, traced_ranks
from .fake_rank import rank_kinds
from .time_model import Cluster, StepTime, step_time


@dataclasses.dataclass(frozen=True)
class Candidate:
    plan: Plan
    recompute: str
    ranks: Tuple[RankMemory, ...]
    time: StepTime

    @property
    def peak(self) -> int:
        return max(r.peak for r in self.ranks)

    def describe(self) -> str:
        p = self.plan
        return (f"TP{p.tp} PP{p.pp} CP{p.cp} EP{p.ep} DP{p.dp} ZeRO-{p.zero_stage} mb{p.micro_batch} "
                f"recompute {self.recompute}" + (f" offload {p.offload}" if p.offload != "none" else ""))

    def flags(self) -> str:
        p = self.plan
        out = (f"--tensor-model-parallel-size {p.tp} --pipeline-model-parallel-size {p.pp} "
               f"--context-parallel-size {p.cp} --zero-stage {p.zero_stage} --micro-batch-size {p.micro_batch}")
        if p.ep > 1:
            out += f" --expert-model-parallel-size {p.ep}"
        if self.recompute != "none":
            out += " --recompute-granularity full --recompute-method uniform"
        if p.offload == "cpu":
            out += " --cpu-optimizer"
        return out


def _powers(limit: int) -> List[int]:
    return [1 << i for i in range(limit.bit_length()) if (1 << i) <= limit]


def layouts(base: Plan, cluster: Cluster, offload: bool = False, near: bool = False) -> Iterator[Tuple[Plan, str]]:
    """`near`: only the run's own TP x PP x CP x EP (micro-batch, recomputation, ZeRO, offload vary)."""
    c = base.config
    groups = c.num_query_groups or c.num_attention_heads
    for tp, pp, cp in itertools.product(_powers(min(cluster.gpus_per_node, cluster.gpus)), _powers(cluster.gpus),
                                        _powers(min(8, cluster.gpus))):
        if groups % tp or c.num_layers % pp or c.seq_length % (2 * cp * tp) or cluster.gpus % (tp * pp * cp):
            continue
        if near and (tp, pp, cp) != (base.tp, base.pp, base.cp):
            continue
        dp = cluster.gpus // (tp * pp * cp)
        for ep in _powers(dp * cp) if c.num_experts else [1]:
            if (c.num_experts and c.num_experts % ep) or (near and ep != base.ep):
                continue
            for zero, mb, recompute in itertools.product(range(4), (1, 2, 4), ("none", "full")):
                if (zero == 3 and pp > 1) or base.global_batch % (mb * dp):
                    continue
                for off in (("none", "cpu") if offload else ("none",)):
                    if off != "none" and zero == 0:
                        continue
                    yield dataclasses.replace(base, tp=tp, pp=pp, cp=cp, ep=ep, dp=dp, zero_stage=zero,
                                              micro_batch=mb, offload=off), recompute


def _with_recompute(config, recompute: str):
    if recompute == "none":
        return dataclasses.replace(config, recompute_granularity=None, recompute_method=None)
    if recompute == "selective" or config.recompute_granularity == "full":
        return dataclasses.replace(config, recompute_granularity=recompute)  # as the run asked
    return dataclasses.replace(config, recompute_granularity="full", recompute_method="uniform",
                               recompute_num_layers=1)


def evaluate(plan: Plan, recompute: str, cluster: Cluster, cache: dict, fp8: bool = False) -> Candidate:
    config = _with_recompute(plan.config, recompute)
    plan = dataclasses.replace(plan, config=config)
    key = (plan.tp, plan.pp, plan.cp, plan.ep, plan.micro_batch, recompute, plan.virtual_stages)
    if key not in cache:
        cache[key] = traced_ranks(plan)
    traced = cache[key]
    ranks = tuple(rank_memory(plan, k.name, k.pp_rank, traced[k.name]) for k in rank_kinds(plan.pp))
    stage_params = max(r.parameters for r in ranks)
    return Candidate(plan, recompute, ranks, step_time(plan, cluster, stage_params, recompute, fp8))


def search(base: Plan, cluster: Cluster, offload: bool = False, fp8: bool = False, limit: int = 10,
           fits_host: bool = True, near: bool = False) -> List[Candidate]:
    """The layouts that fit the GPUs' memory (and, with offload, the host's), best tokens/s first."""
    from .memory import host_bytes_per_node
    cache: dict = {}
    states: dict = {}  # (tp, pp, cp, ep) -> the stages built without a trace: their model states alone
    fitting = []
    for plan, recompute in layouts(base, cluster, offload, near):
        key = (plan.tp, plan.pp, plan.cp, plan.ep)
        if key not in states:
            states[key] = traced_ranks(plan, trace=False)
        untraced = [rank_memory(plan, k.name, k.pp_rank, states[key][k.name]) for k in rank_kinds(plan.pp)]
        if max(r.peak for r in untraced) > cluster.gpu_memory_gib * GIB:
            continue  # the weights, gradients and optimizer state alone do not fit: no trace needed
        cand = evaluate(plan, recompute, cluster, cache, fp8)
        if cand.peak > cluster.gpu_memory_gib * GIB:
            continue
        host = host_bytes_per_node(cand.plan, list(cand.ranks), cluster.gpus_per_node)["total"]
        if fits_host and host > cluster.host_memory_gib * GIB:
            continue
        fitting.append(cand)
    fitting.sort(key=lambda c: -c.time.tokens_per_second)
    return fitting[:limit]
