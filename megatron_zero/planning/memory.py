"""Bytes per rank kind of a layout: model states by ZeRO's partition math, activations from a traced micro-batch.

    weights      the stage's parameters in the training dtype (ZeRO-3: this rank's partition plus the
                 persistent parameters, --zero-param-persistence-threshold, gathered once and kept)
    gradients    fp32: the whole stage's (ZeRO 0/1: the main-grad buffer) or this rank's partition (ZeRO 2/3);
                 under offload the partition is in host memory instead (zero/host_grads.py), ZeRO 0/1 keep
                 their buffer on the device
    optimizer    the fp32 master partition (a flat copy in fp32 runs too) and the optimizer's states per element (OPTIMIZER_STATES),
                 over the padded partition of zero/partition.py (ZeRO >= 1) or whole (ZeRO 0); on the host
                 under --cpu-optimizer, in files under NVMe offload
    activations  one micro-batch's traced peak plus the saved bytes of the micro-batches the schedule
                 keeps in flight on that stage (1F1B: pp - stage, at most the number of micro-batches)
    buffers      the pipeline's send/receive tensors; ZeRO's reduce bucket of --ddp-bucket-size elements
                 (ZeRO-2: fp32; ZeRO-3: its gradients waiting in the model dtype and the fp32 rows they are
                 reduced from), on the device under offload too; ZeRO-3's layers in flight (two of the largest
                 layer's other parameters: the one in use and the one prefetched; at DP 1 too, where a layer's
                 gather is a copy of its shards)
    fp8          what the FP8 converter holds (fp8/convert.py, applied on the fake build): delayed scaling's amax
                 histories and scales; under --fp8-param-gather each FP8 layer's weight in FP8 (1 byte an element)
                 and its scale, which at ZeRO 1/2 is that weight's one copy (its training-dtype weight a
                 one-element placeholder, fp8/param_gather.py) and at ZeRO-3 is held as this rank's FP8 chunk
                 (zero/stage3_fp8.py), gathered (in FP8 and dequantized: buffers) with the other weights
Experts partition over the expert-data-parallel group (DP x CP / EP), the rest over DP x CP.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Dict, List, Optional, Tuple

import torch

from ..config.optimizer import PERSISTENCE_THRESHOLD, REDUCE_BUCKET_SIZE
from ..zero.partition import partition_group, zero3_param_partition
from .fake_rank import NO_CONVERSION, Conversion, TracedRank, rank_kinds, trace_rank
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
    bucket_elements: int = REDUCE_BUCKET_SIZE  # ZeRO's reduce bucket: the run's --ddp-bucket-size
    persistence_threshold: int = PERSISTENCE_THRESHOLD  # ZeRO-3: --zero-param-persistence-threshold
    virtual_stages: int = 1
    conversion: Conversion = NO_CONVERSION  # the run's model converters: FP8, the output loss (fake_rank.py)

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
    fp8: int = 0           # the FP8 converter's: amax histories, scales, FP8 weights (--fp8-param-gather)

    @property
    def peak(self) -> int:
        return self.weights + self.gradients + self.optimizer + self.activations + self.buffers + self.fp8

    def as_dict(self) -> dict:
        return {**asdict(self), "peak": self.peak}

    def largest_parts(self, n: int = 2) -> List[str]:
        parts = {k: getattr(self, k) for k in ("weights", "gradients", "optimizer", "activations", "buffers", "fp8")}
        return [f"{k} {size(v)}" for k, v in sorted(parts.items(), key=lambda kv: -kv[1])[:n]]


def size(nbytes: float) -> str:
    """GiB with one decimal, MiB below a GiB."""
    return f"{nbytes / GIB:.1f} GiB" if nbytes >= GIB else f"{nbytes / 2 ** 20:.1f} MiB"


def traced_ranks(plan: Plan, trace: bool = True, probes: Optional[Probes] = None,
                 exact: bool = False) -> Dict[str, TracedRank]:
    """Each rank kind's stage: scaled from probes of one and two blocks where its blocks are alike (probe.py;
    `probes` of plan.config and dtype, reused across calls), else (or `exact`) built and traced whole."""
    if not exact and scalable(plan.config, plan.pp, plan.virtual_stages):
        probes = probes or Probes(plan.config, plan.dtype, plan.conversion)
        return {k.name: probes.rank(k.name, plan.pp, k.pp_rank, plan.degrees(), plan.micro_batch, trace)
                for k in rank_kinds(plan.pp)}
    return {k.name: trace_rank(plan.config, plan.degrees(), k.pp_rank, plan.micro_batch, plan.dtype,
                               virtual_stages=plan.virtual_stages, trace=trace, conversion=plan.conversion)
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
    in_fp8 = [p for p in traced.params if p.fp8_gathered]  # --fp8-param-gather: held in FP8 (fp8 below)
    fp8 = sum(p.fp8_bytes for p in traced.params)
    if plan.zero_stage == 3:
        dp_of = {name: dp for group, dp, _ in groups for name, _ in group}
        chunks8 = sum(zero3_param_partition(p.numel, dp_of[p.name])[0] for p in in_fp8)
        (kept, kept8), (flying, flying8) = _gathered(traced.params, plan.persistence_threshold)
        weights = (sum(local) - chunks8 + kept) * wb  # the bf16 chunks and the persistent parameters, gathered
        fp8 += chunks8 + kept8 - sum(p.numel for p in in_fp8)  # FP8 chunks, not whole FP8 weights at rest
        gathering = flying * wb + flying8  # the layers gathered (an FP8 weight dequantized and in FP8)
    else:
        weights = (numel - sum(p.numel for p in in_fp8) + len(in_fp8)) * wb  # (a placeholder's one element)
        gathering = 0
    # ZeRO-2's fp32 bucket; ZeRO-3's gradients wait in the model dtype, then go into fp32 rows (zero/stage3.py)
    bucket = min(plan.bucket_elements, numel) * (wb + 4 if plan.zero_stage == 3 else 4) if plan.zero_stage >= 2 else 0
    offloaded = plan.offload != "none"
    partition_grads = 0 if offloaded else sum(local) * 4  # on the host under offload (zero/host_grads.py)
    gradients = numel * 4 if plan.zero_stage < 2 else partition_grads
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
    return RankMemory(kind, numel, weights, gradients, optimizer, activations, p2p + bucket + gathering, host, nvme,
                      sum(local), host_gradients, fp8)


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


def _gathered(params, persistence_threshold: int) -> Tuple[Tuple[int, int], Tuple[int, int]]:
    """ZeRO-3's gathered weights (zero/stage3.py), at any DP size (at DP 1 a layer's gather is a copy of its
    shards): the persistent parameters (at most `persistence_threshold` elements), gathered once and kept, and
    of the others two of the largest layer's (the one in use and the one prefetched), their total at most,
    in flight; -> ((kept elements, those in FP8), (in-flight elements, those in FP8)): an FP8-gathered weight
    is held in FP8 as well."""
    kept = [p for p in params if p.numel <= persistence_threshold]
    per_layer: Dict[str, List[int]] = {}
    for p in params:
        if p.numel > persistence_threshold:
            layer = per_layer.setdefault(p.name.split(".")[0], [0, 0])
            layer[0] += p.numel
            layer[1] += p.numel if p.fp8_gathered else 0
    largest = max(per_layer.values(), default=[0, 0])
    others = [sum(n for n, _ in per_layer.values()), sum(n8 for _, n8 in per_layer.values())]
    return ((sum(p.numel for p in kept), sum(p.numel for p in kept if p.fp8_gathered)),
            (min(others[0], 2 * largest[0]), min(others[1], 2 * largest[1])))


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
