"""Bytes per rank kind of a layout: model states by ZeRO's partition math, activations from a traced micro-batch.

    weights      the stage's parameters in the training dtype (ZeRO-3: this rank's partition plus the
                 gathered copies of the two largest layers in flight, fetch and prefetch; at DP 1 all of them)
    gradients    fp32: the whole stage's (ZeRO 0/1: the main-grad buffer) or this rank's partition plus
                 the reduce buckets (ZeRO 2/3); under offload the partition is in host memory instead
                 (zero/host_grads.py): ZeRO 2/3 keep only the bucket on the device, ZeRO 0/1 their buffer
    optimizer    the fp32 master partition (a flat copy in fp32 runs too) and the optimizer's states per element (OPTIMIZER_STATES),
                 over the padded partition of zero/partition.py (ZeRO >= 1) or whole (ZeRO 0); on the host
                 under --cpu-optimizer, in files under NVMe offload
    activations  one micro-batch's traced peak plus the saved bytes of the micro-batches the schedule
                 keeps in flight on that stage (1F1B: pp - stage, at most the number of micro-batches)
    buffers      the pipeline's send/receive tensors and ZeRO's gradient buckets
Experts partition over the expert-data-parallel group (DP x CP / EP), the rest over DP x CP.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Dict, List, Optional, Tuple

import torch

from ..zero.partition import partition_group, zero3_param_partition
from .fake_rank import TracedRank, rank_kinds, trace_rank
from .probe import Probes, scalable

# elements of optimizer state per parameter element, by optimizer: what a new optimizer plugs in
# (Muon's optimizers: its momentum on the blocks' matrices, AdamW's two moments on the rest: optimizer_groups)
OPTIMIZER_STATES = {"adam": 2, "adamw": 2, "muon": 1}
MUON_OPTIMIZERS = ("muon", "dist_muon")
DTYPE_BYTES = {torch.float32: 4, torch.bfloat16: 2, torch.float16: 2}
GIB = 2 ** 30


@dataclass(frozen=True)
class Plan:
    """What tools/plan.py plans: the model, the layout and the run's memory-relevant settings."""

    config: object                 # GPTConfig
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    dp: int = 1
    zero_stage: int = 1
    micro_batch: int = 1
    global_batch: int = 1
    dtype: torch.dtype = torch.bfloat16
    offload: str = "none"          # none, cpu, nvme
    optimizer: str = "adam"
    bucket_elements: int = 500_000_000 // 4  # reduce bucket (DeepSpeed's reduce_bucket_size default 5e8 bytes)
    virtual_stages: int = 1

    @property
    def gpus(self) -> int:
        return self.tp * self.pp * self.cp * self.dp

    @property
    def num_micro_batches(self) -> int:
        return max(1, self.global_batch // (self.micro_batch * self.dp))

    def degrees(self) -> dict:
        return dict(tp=self.tp, pp=self.pp, cp=self.cp, ep=self.ep, etp=None)


@dataclass(frozen=True)
class RankMemory:
    kind: str
    parameters: int        # this rank's parameter elements (TP/PP/EP-local, before ZeRO)
    weights: int
    gradients: int
    optimizer: int         # on the device (0 under offload)
    activations: int
    buffers: int
    host_optimizer: int    # offloaded to host memory (--cpu-optimizer)
    nvme_optimizer: int    # offloaded to files
    partition: int = 0     # this rank's fp32 partition elements (the master copy's)
    host_gradients: int = 0  # under offload: the fp32 gradient partition and the slots it comes down through

    @property
    def peak(self) -> int:
        return self.weights + self.gradients + self.optimizer + self.activations + self.buffers

    def as_dict(self) -> dict:
        return {**asdict(self), "peak": self.peak}

    def largest_parts(self, n: int = 2) -> List[str]:
        parts = {k: getattr(self, k) for k in ("weights", "gradients", "optimizer", "activations", "buffers")}
        return [f"{k} {size(v)}" for k, v in sorted(parts.items(), key=lambda kv: -kv[1])[:n]]


def size(nbytes: float) -> str:
    """GiB with one decimal, MiB below a GiB."""
    return f"{nbytes / GIB:.1f} GiB" if nbytes >= GIB else f"{nbytes / 2 ** 20:.1f} MiB"


def traced_ranks(plan: Plan, trace: bool = True, probes: Optional[Probes] = None,
                 exact: bool = False) -> Dict[str, TracedRank]:
    """Each rank kind's stage: scaled from probes of one and two blocks where its blocks are alike (probe.py;
    `probes` of plan.config and dtype, reused across calls), else (or `exact`) built and traced whole."""
    if not exact and scalable(plan.config, plan.pp, plan.virtual_stages):
        probes = probes or Probes(plan.config, plan.dtype)
        return {k.name: probes.rank(k.name, plan.pp, k.pp_rank, plan.degrees(), plan.micro_batch, trace)
                for k in rank_kinds(plan.pp)}
    return {k.name: trace_rank(plan.config, plan.degrees(), k.pp_rank, plan.micro_batch, plan.dtype,
                               virtual_stages=plan.virtual_stages, trace=trace)
            for k in rank_kinds(plan.pp)}


def optimizer_groups(plan: Plan, params) -> List[Tuple[List[Tuple[str, int]], int, int]]:
    """The flat groups ZeRO partitions, as optimizer_setup.param_groups and ZeroOptimizer form them: decay
    and no_decay always (Muon's matrices first, in a group of their own, under --optimizer muon), each
    split into its dense part over DP x CP and, with expert parallelism, its experts' over the
    expert-data-parallel group. Each as (named numels, its DP size, optimizer states per element)."""
    muon = plan.optimizer in MUON_OPTIMIZERS
    kinds = (["muon"] if muon and any(p.group == "muon" for p in params) else []) + ["decay", "no_decay"]
    dp_dense, dp_expert = plan.dp * plan.cp, max(1, plan.dp * plan.cp // plan.ep)
    split_experts = plan.ep > 1
    dense, experts = [], []
    for kind in kinds:
        members = [p for p in params if (p.group if muon or p.group != "muon" else "decay") == kind]
        states = OPTIMIZER_STATES["muon" if kind == "muon" else "adam"] if muon else OPTIMIZER_STATES[plan.optimizer]
        dense.append(([(p.name, p.numel) for p in members if not (split_experts and p.expert)], dp_dense, states))
        mine = [(p.name, p.numel) for p in members if split_experts and p.expert]
        if mine:
            experts.append((mine, dp_expert, states))
    return dense + experts


def rank_memory(plan: Plan, kind: str, pp_rank: int, traced: TracedRank) -> RankMemory:
    """The bytes of one rank kind, from its traced stage."""
    wb = DTYPE_BYTES[plan.dtype]
    groups = optimizer_groups(plan, traced.params)
    numel = sum(p.numel for p in traced.params)
    if plan.zero_stage == 3:
        local = [sum(zero3_param_partition(k, dp)[0] for _, k in group) for group, dp, _ in groups]
    elif plan.zero_stage >= 1:
        local = [partition_group(group, dp).partition_size for group, dp, _ in groups]
    else:
        local = [sum(k for _, k in group) for group, _, _ in groups]
    if plan.zero_stage == 3:
        gathered = numel if plan.dp * plan.cp == 1 else min(numel, 2 * _largest_layer(traced.params))
        weights = (sum(local) + gathered) * wb
    else:
        weights = numel * wb
    bucket = min(plan.bucket_elements, numel) * 4
    offloaded = plan.offload != "none"
    partition_grads = 0 if offloaded else sum(local) * 4  # on the host under offload (zero/host_grads.py)
    gradients = numel * 4 if plan.zero_stage < 2 else partition_grads + (bucket if plan.zero_stage == 2 else 0)
    host_gradients = sum(local) * 4 + host_grad_slots(plan, groups, local) * 4 if offloaded else 0
    # the fp32 master partition (in fp32 runs too) and each group's optimizer states
    states = sum((per_element + 1) * n * 4 for n, (_, _, per_element) in zip(local, groups))
    optimizer, host, nvme = states, 0, 0
    if plan.offload == "cpu":
        optimizer, host = 0, states
    elif plan.offload == "nvme":
        optimizer, nvme = 0, states
    in_flight = min(plan.pp - pp_rank, plan.num_micro_batches) if plan.pp > 1 else 1
    activations = traced.peak_bytes + (in_flight - 1) * traced.saved_bytes
    seq = plan.config.seq_length // plan.cp
    p2p = 2 * plan.micro_batch * seq * plan.config.hidden_size * wb if plan.pp > 1 else 0
    return RankMemory(kind, numel, weights, gradients, optimizer, activations, p2p, host, nvme, sum(local),
                      host_gradients)


def host_grad_slots(plan: Plan, groups, local: List[int]) -> int:
    """Elements of the host slots an offloaded run's reduced buckets come down through (zero/host_grads.py):
    SLOTS of the widest bucket, ZeRO 0/1's strided buckets and ZeRO 2's contiguous ones as GradBuckets forms
    them (grown to a partition at most), ZeRO 3's of its bucket size (its partitions' total at most)."""
    from ..zero.host_grads import SLOTS
    from ..zero.partition import contiguous_buckets, strided_buckets
    if plan.zero_stage == 3:
        return SLOTS * min(plan.bucket_elements, sum(local))
    widths = []
    for group, dp, _ in groups:
        part = partition_group(group, dp if plan.zero_stage else 1)
        layouts = (strided_buckets(part, plan.bucket_elements) if plan.zero_stage < 2 else
                   contiguous_buckets(part, plan.bucket_elements))
        widths += [lay.width for lay in layouts]
    return SLOTS * max(widths, default=1)


def _largest_layer(params) -> int:
    per_layer: Dict[str, int] = {}
    for p in params:
        top = p.name.split(".")[0]
        per_layer[top] = per_layer.get(top, 0) + p.numel
    return max(per_layer.values())


def plan_memory(plan: Plan, trace: bool = True, exact: bool = False) -> List[RankMemory]:
    traced = traced_ranks(plan, trace, exact=exact)
    return [rank_memory(plan, k.name, k.pp_rank, traced[k.name]) for k in rank_kinds(plan.pp)]


def host_bytes_per_node(plan: Plan, ranks: List[RankMemory], gpus_per_node: int) -> Dict[str, int]:
    """Host memory of one node: the offloaded masters and optimizer states of its ranks; the pinned buffers
    under offload (the fp32 gradient partition and the slots it comes down through, zero/host_grads.py;
    zero/offload.py's UPLOAD_SLOTS chunks of the model dtype the new weights go up through, from a GPU); a
    checkpoint save's staging of the largest rank's model states on the host."""
    from ..zero.offload import OFFLOAD_CHUNK_NUMEL, UPLOAD_SLOTS
    worst = max(ranks, key=lambda r: r.host_optimizer + r.weights)
    per_rank_optimizer = worst.host_optimizer
    pinned = 0
    if plan.offload != "none":
        chunk = min(OFFLOAD_CHUNK_NUMEL, worst.partition)
        slots = UPLOAD_SLOTS * chunk * DTYPE_BYTES[plan.dtype] if plan.dtype != torch.float32 else 0
        pinned = worst.host_gradients + slots
    staging = worst.weights + (0 if plan.offload == "cpu" else worst.optimizer + worst.nvme_optimizer)
    n = min(gpus_per_node, plan.gpus)
    return dict(optimizer=n * per_rank_optimizer, pinned=n * pinned, checkpoint_staging=n * staging,
                total=n * (per_rank_optimizer + pinned + staging))
