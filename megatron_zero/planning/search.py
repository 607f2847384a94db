"""Every layout of a cluster that fits, ranked by predicted tokens/s.

Candidates: TP within a node (powers of two dividing the heads), PP dividing the layers, CP, EP dividing the
experts, ZeRO 0-3 (3 only without PP), full or no recomputation, micro-batch 1, 2, 4; DP is what remains
of the GPUs and must divide the global batch. Memory from memory.py (one fake build and trace per
stage kind and TP x CP x recompute x micro-batch, probe.py), time from time_model.py; only the fastest
layouts whose model states fit are traced, until enough fit.
"""
from __future__ import annotations

import dataclasses
import itertools
from typing import Dict, Iterator, List, Optional, Tuple

from .fake_rank import RankKind, rank_kinds, trace_rank
from .memory import GIB, Plan, RankMemory, rank_memory
from .probe import Probes, scalable
from .replay import Replays
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


class StageCache:
    """The stages a search has built or traced, by layout and recomputation: probes (probe.py) shared by
    every layout whose blocks are alike, whole traces of the others (of every layout with `exact`: the
    reference the probes are checked against, tests/test_plan.py)."""

    def __init__(self, exact: bool = False):
        self._probes: Dict[str, Probes] = {}
        self._replays = Replays()  # the loss's and the CP ring's measurements, shared by every probe
        self._exact: dict = {}
        self.exact = exact

    def rank(self, plan: Plan, recompute: str, kind: RankKind, trace: bool = True) -> RankMemory:
        if not self.exact and scalable(plan.config, plan.pp, plan.virtual_stages):
            if recompute not in self._probes:
                self._probes[recompute] = Probes(plan.config, plan.dtype, plan.conversion, self._replays)
            traced = self._probes[recompute].rank(kind.name, plan.pp, kind.pp_rank, plan.degrees(),
                                                  plan.micro_batch, trace)
        else:
            key = (plan.tp, plan.pp, plan.cp, plan.ep, plan.micro_batch if trace else 0, recompute,
                   plan.virtual_stages, kind)
            if key not in self._exact:
                self._exact[key] = trace_rank(plan.config, plan.degrees(), kind.pp_rank, plan.micro_batch,
                                              plan.dtype, virtual_stages=plan.virtual_stages, trace=trace,
                                              conversion=plan.conversion)
            traced = self._exact[key]
        return rank_memory(plan, kind.name, kind.pp_rank, traced)

    def traced(self, plan: Plan, recompute: str, kind: RankKind) -> bool:
        """Whether this kind's micro-batch of `plan` is traced already (rank() costs no trace)."""
        if not self.exact and scalable(plan.config, plan.pp, plan.virtual_stages):
            return recompute in self._probes and self._probes[recompute].traced(kind.name, plan.tp, plan.cp,
                                                                                 plan.micro_batch)
        return (plan.tp, plan.pp, plan.cp, plan.ep, plan.micro_batch, recompute, plan.virtual_stages,
                kind) in self._exact

    def ranks(self, plan: Plan, recompute: str, trace: bool = True, limit: float = float("inf"),
              least: Optional[Plan] = None, lesser=()):
        """Every rank kind's memory, or None as soon as one kind's peak exceeds `limit` bytes, or, given the
        layout's `least` plan (full recomputation, micro-batch 1), that kind's under it, or under one of the
        `lesser` (plan, recompute) that is traced already."""
        out = []
        for kind in rank_kinds(plan.pp):
            if least is not None and self.rank(least, "full", kind).peak > limit:
                return None
            if any(self.traced(p, r, kind) and self.rank(p, r, kind).peak > limit for p, r in lesser):
                return None
            out.append(self.rank(plan, recompute, kind, trace))
            if out[-1].peak > limit:
                return None
        return tuple(out)


def evaluate(plan: Plan, recompute: str, cluster: Cluster, cache: Optional[StageCache] = None,
             fp8: bool = False) -> Candidate:
    plan = dataclasses.replace(plan, config=_with_recompute(plan.config, recompute))
    ranks = (cache or StageCache()).ranks(plan, recompute)
    stage_params = max(r.parameters for r in ranks)
    return Candidate(plan, recompute, ranks, step_time(plan, cluster, stage_params, recompute, fp8))


def _lesser(plan: Plan, recompute: str) -> List[Tuple[Plan, str]]:
    """The same layout with a smaller micro-batch or full recomputation (as many micro-batches): each holds
    fewer activations, so where one does not fit, neither does `plan`."""
    out = []
    for mb in (1, 2, 4):
        for r in (recompute, "full"):
            if mb <= plan.micro_batch and (mb, r) != (plan.micro_batch, recompute):
                out.append((dataclasses.replace(plan, micro_batch=mb, config=_with_recompute(plan.config, r),
                                                global_batch=plan.global_batch // plan.micro_batch * mb), r))
    return out


def search(base: Plan, cluster: Cluster, offload: bool = False, fp8: bool = False, limit: int = 10,
           fits_host: bool = True, near: bool = False, exact: bool = False) -> List[Candidate]:
    """The layouts that fit the GPUs' memory (and, with offload, the host's), best tokens/s first.

    The step time needs no trace: every layout whose model states alone fit is timed, and only the fastest
    are traced, in order, until `limit` fit (a trace is the costly part). A layout's rank kinds are traced
    one at a time, stopping at the first that does not fit, each only where the same kind of the same
    layout at micro-batch 1 with full recomputation fits (it holds the fewest activations: if it does not
    fit, no micro-batch or recomputation of that layout does), and where no smaller micro-batch or fuller
    recomputation of it traced already fails (`_lesser`: the same rule, at no trace's cost)."""
    from .memory import host_bytes_per_node
    cache = StageCache(exact)
    device = cluster.gpu_memory_gib * GIB
    timed = []
    for plan, recompute in layouts(base, cluster, offload, near):
        plan = dataclasses.replace(plan, config=_with_recompute(plan.config, recompute))
        states = cache.ranks(plan, recompute, trace=False)
        if max(r.peak for r in states) > device:
            continue  # the weights, gradients and optimizer state alone do not fit: no trace needed
        time = step_time(plan, cluster, max(r.parameters for r in states), recompute, fp8)
        timed.append((plan, recompute, time))
    timed.sort(key=lambda t: -t[2].tokens_per_second)
    fitting = []
    for plan, recompute, time in timed:
        least = dataclasses.replace(plan, micro_batch=1, global_batch=plan.global_batch // plan.micro_batch,
                                    config=_with_recompute(plan.config, "full"))  # as many micro-batches
        ranks = cache.ranks(plan, recompute, limit=device,
                            least=least if (plan.micro_batch, recompute) != (1, "full") else None,
                            lesser=_lesser(plan, recompute))
        if ranks is None:
            continue
        cand = Candidate(plan, recompute, ranks, time)
        host = host_bytes_per_node(cand.plan, list(cand.ranks), cluster.gpus_per_node)["total"]
        if fits_host and host > cluster.host_memory_gib * GIB:
            continue
        fitting.append(cand)
        if len(fitting) == limit:
            break
    return fitting
