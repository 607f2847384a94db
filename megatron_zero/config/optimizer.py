"""The optimizer's flags (AdamW, learning rates, clipping, precision and loss scaling) and ZeRO's (stage,
offload, overlap, ZeRO++): their checks and derived values (args.offload, args.overlap_param_gather's
default, args.cpu_optimizer_threads, args.params_dtype)."""
from __future__ import annotations

import argparse
import math
import os
from typing import Optional

from .errors import require
from .fields import add_section_flags, derived, flag, section


ZERO = "ZeRO and offload"  # the flags' second group in --help
REDUCE_BUCKET_SIZE = 50_000_000  # --ddp-bucket-size's default: elements of a gradient reduce bucket
PERSISTENCE_THRESHOLD = 100_000  # --zero-param-persistence-threshold's default (DeepSpeed's)


@section("optimizer and precision")
class OptimizerConfig:
    """AdamW, its learning rates, clipping, precision and loss scaling, and ZeRO, checked; ZeroOptimizer is built
    from it (zero/build.py)."""
    lr: Optional[float] = flag("peak learning rate")
    min_lr: float = flag("the learning rate's floor at the end of decay", 0.0)
    decoupled_lr: Optional[float] = flag("the word embedding's and output layer's own peak learning rate "
                                         "(Megatron's); they follow the same warm-up and decay")
    decoupled_min_lr: Optional[float] = flag("their floor, with --decoupled-lr (default --min-lr)")
    weight_decay: float = flag("AdamW's decoupled weight decay on matrices and embeddings (none on biases and "
                               "norms)", 0.01)
    clip_grad: float = flag("clip the global gradient L2 norm to this (0: no clipping)", 1.0)
    adam_beta1: float = flag("Adam's first-moment decay", 0.9)
    adam_beta2: float = flag("Adam's second-moment decay", 0.999)
    adam_eps: float = flag("Adam's epsilon", 1e-8)
    bf16: bool = flag("train in bfloat16 with fp32 master weights", False, action="store_true")
    fp16: bool = flag("train in float16 with fp32 master weights and loss scaling", False, action="store_true")
    loss_scale: Optional[float] = flag("static loss scale of --fp16 (default: dynamic) or --bf16 (default: none), "
                                       "as Megatron-LM")
    initial_loss_scale: float = flag("--fp16's dynamic loss scale at the start (rounded down to a power of 2)",
                                     2.0 ** 16)
    loss_scale_window: int = flag("steps without overflow before the dynamic loss scale doubles", 1000)
    min_loss_scale: float = flag("the dynamic loss scale's floor", 1.0)
    hysteresis: int = flag("overflows tolerated before the dynamic loss scale halves", 2)
    zero_stage: int = flag("ZeRO stage: 0 replicated optimizer, 1 optimizer state, 2 also gradients, 3 also "
                           "parameters partitioned over DP", 1, group=ZERO, choices=[0, 1, 2, 3])
    # none, cpu (the flag), or nvme (set by the check from --zero-nvme-offload-path)
    offload: str = flag("keep fp32 masters and Adam state in host memory (ZeRO-Offload)", "none", group=ZERO,
                        names=("--cpu-optimizer", "--zero-cpu-offload"), action="store_const", const="cpu")
    zero_param_persistence_threshold: int = flag(
        "ZeRO-3: parameters of at most this many elements stay gathered (DeepSpeed's "
        "stage3_param_persistence_threshold; 0 gathers every parameter per layer)", PERSISTENCE_THRESHOLD, group=ZERO)
    zero_nvme_offload_path: Optional[str] = flag("keep optimizer state in files under this path (ZeRO-Infinity "
                                                 "style)", group=ZERO)
    use_distributed_optimizer: bool = flag("Megatron's distributed optimizer: ZeRO-1 (the default --zero-stage)",
                                           False, group=ZERO, action="store_true")
    overlap_grad_reduce: bool = flag("ZeRO 0-2: reduce gradient buckets asynchronously during backward", False,
                                     group=ZERO, action="store_true")
    # None until checked: on by default at ZeRO-3
    overlap_param_gather: Optional[bool] = flag(
        "ZeRO 1/2: all-gather updated weights asynchronously, waited on at first use; ZeRO-3: prefetch the next "
        "layer (on by default there, as in DeepSpeed)", group=ZERO, action="store_true")
    zero_quantized_weights: bool = flag("ZeRO++ qwZ (ZeRO-3): all-gather weights as int8 blocks (DeepSpeed's "
                                        "zero_quantized_weights)", False, group=ZERO, action="store_true")
    zero_quantized_gradients: bool = flag("ZeRO++ qgZ (ZeRO-3): reduce-scatter gradients as int8 blocks "
                                          "(zero_quantized_gradients)", False, group=ZERO, action="store_true")
    zero_hpz_partition_size: int = flag("ZeRO++ hpZ (ZeRO-3): backward re-gathers weights within blocks of this "
                                        "many DP ranks (zero_hpz_partition_size; 1: off)", 1, group=ZERO)
    ddp_bucket_size: int = flag(
        "elements of ZeRO's gradient reduce buckets (Megatron-LM's --ddp-bucket-size, DeepSpeed's "
        "zero_optimization.reduce_bucket_size): ZeRO-2/3 hold one bucket beside the gradient partition, ZeRO 0/1 "
        "reduce their fp32 buffer in buckets of this size", REDUCE_BUCKET_SIZE, group=ZERO)
    grad_reduce_in_bf16: bool = flag("ZeRO 0-2 and the tied-embedding sum: reduce gradients in bfloat16 (half the "
                                     "bytes); micro-batches are still accumulated in fp32", False, group=ZERO,
                                     action="store_true")
    cpu_optimizer_threads: Optional[int] = flag(
        "threads of the offloaded optimizer step (--cpu-optimizer, --zero-nvme-offload-path); default: this rank's "
        "share of the node's cores (its CPU affinity / ranks per node)", group=ZERO)
    deepspeed_config: Optional[str] = flag(
        "a DeepSpeed JSON whose batch sizes, ZeRO, precision, optimizer and scheduler settings fill the flags not "
        "given", group=ZERO, names=("--deepspeed-config", "--deepspeed_config"))
    params_dtype: str = derived("fp32, bf16 or fp16, from --bf16/--fp16 (check_precision)")
    deepspeed_scheduler: Optional[dict] = derived("the DeepSpeed JSON's `scheduler` (deepspeed_config.py), or None")

    def loss_scaler(self) -> dict:
        """ZeroOptimizer's loss_scaler settings (DeepSpeed's names)."""
        return {"dynamic": self.loss_scale is None, "static_scale": self.loss_scale or 1.0,
                "initial_scale_power": int(math.log2(self.initial_loss_scale)), "scale_window": self.loss_scale_window,
                "min_scale": self.min_loss_scale, "hysteresis": self.hysteresis}


def add_flags(p: argparse.ArgumentParser) -> None:
    add_section_flags(p, OptimizerConfig)
    p.set_defaults(deepspeed_scheduler=None)  # the JSON's `scheduler`, set by deepspeed_config.py


def check_precision(args) -> None:
    require(not (args.fp16 and args.bf16), "--fp16 and --bf16 cannot both be given; choose one")
    require(args.loss_scale is None or args.fp16 or args.bf16,
            f"--loss-scale {args.loss_scale} scales the loss of --fp16 or --bf16 training; fp32 trains unscaled")
    args.params_dtype = "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32"


def check_lr(args) -> None:
    require(args.lr is not None and args.lr > 0, "--lr is required and must be positive")
    require(0 <= args.min_lr <= args.lr, f"--min-lr {args.min_lr} must lie between 0 and --lr {args.lr}")


def check(args, pp: int) -> None:
    """Adam's numbers, ZeRO's stage against the pipeline, overlap and ZeRO++, offload, --decoupled-lr."""
    for name in ("adam_beta1", "adam_beta2"):
        value = getattr(args, name)
        require(0 <= value < 1, f"--{name.replace('_', '-')} {value} must lie in [0, 1)")
    require(args.ddp_bucket_size >= 1 and float(args.ddp_bucket_size).is_integer(),
            f"--ddp-bucket-size {args.ddp_bucket_size} must be a positive whole number of elements")
    args.ddp_bucket_size = int(args.ddp_bucket_size)  # (the DeepSpeed JSON's reduce_bucket_size may read 5e8)
    require(args.clip_grad >= 0, f"--clip-grad {args.clip_grad} must not be negative (0 disables clipping)")
    require(args.zero_stage < 3 or pp == 1,
            f"--zero-stage 3 partitions parameters across data-parallel ranks and cannot be combined with "
            f"--pipeline-model-parallel-size {pp}; use --zero-stage 1 or 2 with pipelining")
    require(args.zero_param_persistence_threshold >= 0,
            f"--zero-param-persistence-threshold {args.zero_param_persistence_threshold} must not be negative")
    _check_overlap(args)
    if args.zero_nvme_offload_path:
        args.offload = "nvme"
    require(args.offload == "none" or args.zero_stage >= 1,
            f"optimizer offload ({args.offload}) needs --zero-stage 1, 2 or 3, not {args.zero_stage}")
    _check_cpu_optimizer_threads(args)


def _check_overlap(args) -> None:
    """--use-distributed-optimizer, --overlap-*, and ZeRO++'s flags against the ZeRO stage."""
    stage = args.zero_stage
    require(not args.use_distributed_optimizer or stage >= 1,
            f"--use-distributed-optimizer is ZeRO-1 and contradicts --zero-stage {stage}; drop one of them")
    require(not args.overlap_grad_reduce or stage <= 2,
            "--overlap-grad-reduce applies to --zero-stage 0, 1 or 2 (ZeRO-3 reduce-scatters each layer's "
            "gradients during backward already); drop it or choose another stage")
    require(not args.grad_reduce_in_bf16 or stage <= 2,
            "--grad-reduce-in-bf16 applies to --zero-stage 0, 1 or 2 (ZeRO-3 reduce-scatters in fp32); "
            "drop it or choose another stage")
    zeropp = [flag for flag, on in (("--zero-quantized-weights", args.zero_quantized_weights),
                                    ("--zero-quantized-gradients", args.zero_quantized_gradients),
                                    ("--zero-hpz-partition-size", args.zero_hpz_partition_size != 1)) if on]
    require(not zeropp or stage == 3, f"{' and '.join(zeropp)} (ZeRO++) need --zero-stage 3, not {stage}")
    hpz, dp = args.zero_hpz_partition_size, args.data_parallel_size
    require(hpz >= 1 and dp % hpz == 0,
            f"--zero-hpz-partition-size {hpz} (zero_hpz_partition_size) must divide the data-parallel size {dp}")
    if args.overlap_param_gather is None:
        args.overlap_param_gather = stage == 3
    require(not args.overlap_param_gather or stage >= 1,
            "--overlap-param-gather needs --use-distributed-optimizer (ZeRO-1) or --zero-stage 2 or 3: "
            "with --zero-stage 0 there are no parameters to gather")


def _check_cpu_optimizer_threads(args) -> None:
    """--cpu-optimizer-threads: only with an offloaded optimizer, 1 to this machine's cores; default its share."""
    from ..ops.cpu_adam import default_offload_threads
    n, cores = args.cpu_optimizer_threads, os.cpu_count() or 1
    if n is None:
        args.cpu_optimizer_threads = default_offload_threads() if args.offload != "none" else None
        return
    require(args.offload != "none", f"--cpu-optimizer-threads {n} sets the threads of the offloaded optimizer "
            "step; add --cpu-optimizer (or --zero-nvme-offload-path) or drop it")
    require(1 <= n <= cores, f"--cpu-optimizer-threads {n} must lie between 1 and this machine's {cores} cores")


def check_decoupled_lr(args) -> None:
    """--decoupled-lr / --decoupled-min-lr: values, and what cannot carry a second learning rate."""
    if args.decoupled_lr is None:
        require(args.decoupled_min_lr is None, f"--decoupled-min-lr {args.decoupled_min_lr} is the floor of "
                "--decoupled-lr, which is not given; give both, or neither")
        return
    require(args.decoupled_lr > 0, f"--decoupled-lr {args.decoupled_lr} must be positive")
    floor = args.min_lr if args.decoupled_min_lr is None else args.decoupled_min_lr
    require(0 <= floor <= args.decoupled_lr, f"--decoupled-min-lr {floor} must lie between 0 and --decoupled-lr "
            f"{args.decoupled_lr}{' (it defaults to --min-lr)' if args.decoupled_min_lr is None else ''}")
    require(args.deepspeed_scheduler is None, "--decoupled-lr follows Megatron's schedule; the DeepSpeed JSON's "
            "`scheduler` has one learning rate: give --lr-warmup-iters/--lr-decay-iters instead")
    require(not args.save_megatron_deepspeed_layout, "--save-megatron-deepspeed-layout cannot hold --decoupled-lr: "
            "Megatron-DeepSpeed's optimizer has no decoupled param group")
