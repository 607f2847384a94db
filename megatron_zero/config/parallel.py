"""The parallel layout's flags (TP, PP, CP and its exchange, pipeline partition, virtual stages) and the
batch (micro, global, ramp-up): their checks and the sizes derived from them. The data-parallel size and
every cross-degree rule of the ranks come from topology.Layout, which these checks build once."""
from __future__ import annotations

import argparse
from typing import List, Optional

from .batch_schedule import check_reachable, schedule_from_args
from ..context_parallel.comm_types import CP_COMM_TYPES
from ..model.config import GPTConfig
from ..distributed.topology import Layout
from .errors import require
from .fields import add_section_flags, derived, flag, section


@section("parallel layout and batch")
class ParallelConfig:
    """The layout and the batch, checked; the sizes derived from them. build_parallel_state(**degrees()) and
    layout() give the ranks' groups and their arithmetic (distributed/topology.py)."""
    tensor_model_parallel_size: int = flag("ranks each layer's matrices are split over (Megatron's tensor parallelism)",
                                           1)
    pipeline_model_parallel_size: int = flag("pipeline stages the layers are split into", 1)
    sequence_parallel: bool = flag("split LayerNorm and dropout regions along the sequence over the tensor-parallel "
                                   "group (the identity at TP 1, as in Megatron)",
                                   GPTConfig.sequence_parallel, action="store_true")
    context_parallel_size: int = flag("split each sequence over this many ranks (docs/context_parallel.md)", 1)
    cp_comm_type: str = flag("how context-parallel ranks exchange K/V: p2p (ring), all_gather, a2a (Ulysses) or "
                             "a2a+p2p (a2a within groups of consecutive CP ranks, a ring across them)",
                             GPTConfig.cp_comm_type)
    hierarchical_context_parallel_sizes: Optional[List[int]] = flag(
        "--cp-comm-type a2a+p2p: the all-to-all group's size and the ring's, their product CP", nargs="+")
    pipeline_partition_method: str = flag(
        "how layers are spread over the stages without --pipeline-partition: uniform (equal counts) or parameters "
        "(balanced parameter counts)", "uniform", choices=["uniform", "parameters"])
    # parsed as text ("3,5"), checked into the layer counts per stage
    pipeline_partition: Optional[List[int]] = flag("explicit transformer layers per pipeline stage, e.g. 3,5", type=str)
    num_layers_per_virtual_pipeline_stage: Optional[int] = flag(
        "interleaved 1F1B: each pipeline rank holds --num-layers / (PP x N) model chunks of N layers (virtual "
        "stages); the micro-batches per step must be a multiple of PP")
    micro_batch_size: Optional[int] = flag("samples per forward/backward of one data-parallel rank")
    global_batch_size: Optional[int] = flag(
        "samples per optimizer step over all data-parallel ranks (default --micro-batch-size x DP); the rest is "
        "gradient accumulation")
    rampup_batch_size: Optional[List[int]] = flag(
        "Megatron-LM's batch ramp-up (a --train-samples run): the global batch starts at START and grows by "
        "INCREMENT in equal sample intervals to --global-batch-size over SAMPLES samples",
        nargs=3, metavar=("START", "INCREMENT", "SAMPLES"))
    step_batch_size_schedule: Optional[List[str]] = flag(
        "Megatron-LM's step-wise global batch: \"THRESHOLD:BATCH ...\", each batch size from its threshold in tokens "
        "on (K/M/B/T suffixes; the first at 0; megatron_zero/config/batch_schedule.py); one quoted word or several (as an "
        "unquoted array expansion in a script hands them over)", nargs="+", metavar="THRESHOLD:BATCH")
    world_size: int = derived("ranks in the run (check_layout)")
    data_parallel_size: int = derived("world / (TP x PP x CP), from topology.Layout (check_layout)")
    num_micro_batches: int = derived("micro-batches per step at the global batch (check_batch)")
    batch_schedule: object = derived("the global batch of each iteration, a batch_schedule.BatchSchedule (check_batch)")
    virtual_pipeline_model_parallel_size: int = derived("model chunks per pipeline rank, 1 without interleaving "
                                                        "(check_pipeline)")
    cp_a2a_size: int = derived("the all-to-all group's size of --cp-comm-type a2a+p2p, 0 otherwise",
                               value=lambda args: cp_a2a_size(args))
    # the expert degrees are MoE flags (config/moe.py); the ranks' groups are built from all degrees at once
    expert_model_parallel_size: int = derived("--expert-model-parallel-size, checked by config/moe.py")
    expert_tensor_parallel_size: Optional[int] = derived("--expert-tensor-parallel-size (default TP), config/moe.py")

    def degrees(self) -> dict:
        """build_parallel_state's keyword arguments."""
        return dict(tp=self.tensor_model_parallel_size, pp=self.pipeline_model_parallel_size,
                    cp=self.context_parallel_size, ep=self.expert_model_parallel_size,
                    etp=self.expert_tensor_parallel_size, cp_a2a=self.cp_a2a_size)

    def layout(self) -> Layout:
        return Layout.from_world(self.world_size, self.tensor_model_parallel_size, self.pipeline_model_parallel_size,
                                 self.context_parallel_size)


def add_flags(p: argparse.ArgumentParser) -> None:
    add_section_flags(p, ParallelConfig)


def check_layout(args, world_size: int, given: set) -> Layout:
    """TP x PP x CP over `world_size` ranks (Megatron-DeepSpeed's --ds-sequence-parallel-size read as CP);
    sets args.world_size and args.data_parallel_size. `given`: the destinations set on the command line."""
    for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size"):
        value = getattr(args, name)
        require(value >= 1, f"--{name.replace('_', '-')} must be at least 1, got {value}")
    _ulysses_as_context_parallel(args, given)
    cp = args.context_parallel_size
    require(cp >= 1, f"--context-parallel-size must be at least 1, got {cp}")
    layout = Layout.from_world(world_size, args.tensor_model_parallel_size, args.pipeline_model_parallel_size, cp)
    args.world_size, args.data_parallel_size = world_size, layout.dp
    return layout


def check_batch(args, layout: Layout) -> None:
    """--micro-batch-size, --global-batch-size (default micro x DP) and the batch schedule; sets
    args.batch_schedule and args.num_micro_batches."""
    dp = layout.dp
    require(args.micro_batch_size is not None, "--micro-batch-size is required")
    require(args.micro_batch_size >= 1, f"--micro-batch-size {args.micro_batch_size} must be positive")
    if args.global_batch_size is None and args.step_batch_size_schedule is None:
        args.global_batch_size = args.micro_batch_size * dp
    args.batch_schedule = schedule_from_args(args, dp)  # sets --global-batch-size from a step schedule
    mb, gbs = args.micro_batch_size, args.global_batch_size
    require(mb >= 1 and gbs >= 1, f"--micro-batch-size {mb} and --global-batch-size {gbs} must be positive")
    require(gbs % (mb * dp) == 0,
            f"--global-batch-size {gbs} is not divisible by --micro-batch-size {mb} x data-parallel size {dp} "
            f"(world {layout.world_size} / (TP {layout.tp} x PP {layout.pp}))")
    args.num_micro_batches = gbs // (mb * dp)


def check_pipeline(args, layout: Layout) -> None:
    """Layers per stage, micro-batches per step, --pipeline-partition (to a list of counts) and the virtual
    stages (sets args.virtual_pipeline_model_parallel_size)."""
    pp, gbs, mb, dp = layout.pp, args.global_batch_size, args.micro_batch_size, layout.dp
    require(args.num_layers >= pp, f"--num-layers {args.num_layers} is fewer than --pipeline-model-parallel-size "
            f"{pp}; every stage needs at least one layer")
    require(pp == 1 or args.num_micro_batches >= pp,
            f"{args.num_micro_batches} micro-batches per step (--global-batch-size {gbs} / (--micro-batch-size "
            f"{mb} x DP {dp})) is fewer than --pipeline-model-parallel-size {pp}; the pipeline would idle")
    if args.pipeline_partition:
        try:
            counts = [int(x) for x in args.pipeline_partition.split(",")]
        except ValueError:
            counts = []
        require(len(counts) == pp and min(counts) >= 1 and sum(counts) == args.num_layers,
                f"--pipeline-partition {args.pipeline_partition} must list {pp} positive layer counts "
                f"(one per stage of --pipeline-model-parallel-size) summing to --num-layers {args.num_layers}")
        args.pipeline_partition = counts
    _check_virtual_pipeline(args, pp)


def check_schedule_reachable(args) -> None:
    """A global batch that grows reaches each size at a step the pipeline can run (batch_schedule.py)."""
    if args.batch_schedule.varies:
        check_reachable(args.batch_schedule, args.train_iters, args.pipeline_model_parallel_size,
                        args.virtual_pipeline_model_parallel_size > 1)


def _check_virtual_pipeline(args, pp: int) -> None:
    """--num-layers-per-virtual-pipeline-stage N -> args.virtual_pipeline_model_parallel_size, Megatron's rules."""
    n, layers = args.num_layers_per_virtual_pipeline_stage, args.num_layers
    args.virtual_pipeline_model_parallel_size = 1
    if n is None:
        return
    require(pp > 1, "--num-layers-per-virtual-pipeline-stage interleaves pipeline stages and needs "
                    f"--pipeline-model-parallel-size of at least 2, not {pp}")
    require(n >= 1 and layers % (pp * n) == 0,
            f"--num-layers {layers} is not divisible by --pipeline-model-parallel-size {pp} x "
            f"--num-layers-per-virtual-pipeline-stage {n}; each pipeline rank holds chunks of N layers")
    require(args.pipeline_partition is None and args.pipeline_partition_method == "uniform",
            "--pipeline-partition and --pipeline-partition-method parameters cannot be combined with "
            "--num-layers-per-virtual-pipeline-stage, whose virtual stages hold N layers each")
    args.virtual_pipeline_model_parallel_size = v = layers // (pp * n)
    m = args.num_micro_batches
    require(v == 1 or m % pp == 0,
            f"{m} micro-batches per step (--global-batch-size {args.global_batch_size} / (--micro-batch-size "
            f"{args.micro_batch_size} x DP {args.data_parallel_size})) is not divisible by "
            f"--pipeline-model-parallel-size {pp}, which the interleaved schedule of "
            "--num-layers-per-virtual-pipeline-stage needs")


def _ulysses_as_context_parallel(args, given: set) -> None:
    """Megatron-DeepSpeed's --ds-sequence-parallel-size N (DeepSpeed-Ulysses) is context parallelism over N
    ranks with the all-to-all that scatters heads: --context-parallel-size N --cp-comm-type a2a."""
    ds = args.ds_sequence_parallel_size
    if ds == 1:
        return
    require(ds > 1, f"--ds-sequence-parallel-size must be at least 1, got {ds}")
    require(args.context_parallel_size in (1, ds),
            f"--ds-sequence-parallel-size {ds} and --context-parallel-size {args.context_parallel_size} name two "
            "sequence splits; give one of them")
    require("cp_comm_type" not in given or args.cp_comm_type == "a2a",
            f"--ds-sequence-parallel-size {ds} is DeepSpeed-Ulysses, the a2a exchange; it contradicts "
            f"--cp-comm-type {args.cp_comm_type}")
    args.context_parallel_size, args.cp_comm_type = ds, "a2a"


def cp_a2a_size(args) -> int:
    """The all-to-all group's size of --cp-comm-type a2a+p2p (build_parallel_state's cp_a2a); 0 otherwise."""
    return args.hierarchical_context_parallel_sizes[0] if args.cp_comm_type == "a2a+p2p" else 0


def _check_hierarchical_cp(args, tp: int) -> None:
    """--hierarchical-context-parallel-sizes A P with --cp-comm-type a2a+p2p (Megatron-Core's meaning)."""
    cp, kind, sizes = args.context_parallel_size, args.cp_comm_type, args.hierarchical_context_parallel_sizes
    if kind != "a2a+p2p":
        require(sizes is None, f"--hierarchical-context-parallel-sizes applies to --cp-comm-type a2a+p2p, not {kind}")
        return
    require(sizes is not None and len(sizes) == 2 and min(sizes) >= 1 and sizes[0] * sizes[1] == cp,
            f"--cp-comm-type a2a+p2p needs --hierarchical-context-parallel-sizes A P: the all-to-all group's size "
            f"and the ring's, with A x P = --context-parallel-size {cp} (given: {sizes})")
    heads = args.num_attention_heads // tp
    require(heads % sizes[0] == 0,
            f"--cp-comm-type a2a+p2p scatters each tensor-parallel rank's {heads} attention heads "
            f"(--num-attention-heads {args.num_attention_heads} / --tensor-model-parallel-size {tp}) over the "
            f"all-to-all size {sizes[0]} of --hierarchical-context-parallel-sizes, which does not divide them")


def check_context_parallel(args, tp: int) -> None:
    """--context-parallel-size and --cp-comm-type: the layouts and the compositions context parallelism has."""
    cp, kind = args.context_parallel_size, args.cp_comm_type
    require(kind in CP_COMM_TYPES, f"--cp-comm-type {kind} is not available; use p2p (ring exchange of K/V), "
            "all_gather, a2a (Ulysses' head scatter) or a2a+p2p (a2a within groups, a ring across them)")
    _check_hierarchical_cp(args, tp)
    if cp == 1:
        return
    seq = args.seq_length
    require(seq % (2 * cp) == 0,
            f"--seq-length {seq} is not a multiple of 2 x --context-parallel-size {cp}: each rank holds two of "
            f"{2 * cp} equal chunks of the sequence")
    require(not args.sequence_parallel or (seq // cp) % tp == 0,
            f"--sequence-parallel splits each context-parallel rank's {seq // cp} tokens (--seq-length {seq} / "
            f"--context-parallel-size {cp}) over --tensor-model-parallel-size {tp}, which does not divide them")
    heads = args.num_attention_heads // tp
    require(kind != "a2a" or heads % cp == 0,
            f"--cp-comm-type a2a scatters each tensor-parallel rank's {heads} attention heads (--num-attention-heads "
            f"{args.num_attention_heads} / --tensor-model-parallel-size {tp}) over --context-parallel-size {cp}, "
            "which does not divide them; use p2p or all_gather")
    refused = [(args.zero_hpz_partition_size > 1, "--zero-hpz-partition-size")]
    if kind == "all_gather":  # computes attention blocks itself; a2a runs --attention-backend's core
        refused += [(args.attention_backend != "auto", f"--attention-backend {args.attention_backend} (it applies "
                                                       "to --cp-comm-type a2a, p2p and a2a+p2p)")]
    elif kind != "a2a":  # the ring's blocks: the flash kernel or block_attention's pieces (context_parallel/)
        refused += [(args.attention_backend == "fused", "--attention-backend fused (no fused softmax over ring "
                                                        "blocks; use flash, unfused or auto)"),
                    (args.attention_backend == "flash" and args.attention_dropout > 0,
                     "--attention-backend flash with --attention-dropout (the ring's flash kernel runs without "
                     "dropout; auto draws the dropout masks by the block path)")]
    for refuse, what in refused:
        require(not refuse, f"--context-parallel-size {cp} with --cp-comm-type {kind} cannot be combined with {what}")
