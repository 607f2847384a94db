"""The optimizer's flags (AdamW, learning rates, clipping, precision and loss scaling) and ZeRO's (stage,
offload, overlap, ZeRO++): their checks and derived values (args.offload, args.overlap_param_gather's
default, args.cpu_optimizer_threads, args.params_dtype)."""
from __future__ import annotations

import argparse
import os

from .errors import require


def add_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("optimizer and precision")
    g.add_argument("--lr", type=float, default=None,
                   help="peak learning rate")
    g.add_argument("--min-lr", type=float, default=0.0,
                   help="the learning rate's floor at the end of decay")
    g.add_argument("--decoupled-lr", type=float, default=None,
                   help="the word embedding's and output layer's own peak learning rate (Megatron's); they follow "
                        "the same warm-up and decay")
    g.add_argument("--decoupled-min-lr", type=float, default=None,
                   help="their floor, with --decoupled-lr (default --min-lr)")
    g.add_argument("--weight-decay", type=float, default=0.01,
                   help="AdamW's decoupled weight decay on matrices and embeddings (none on biases and norms)")
    g.add_argument("--clip-grad", type=float, default=1.0,
                   help="clip the global gradient L2 norm to this (0: no clipping)")
    g.add_argument("--adam-beta1", type=float, default=0.9,
                   help="Adam's first-moment decay")
    g.add_argument("--adam-beta2", type=float, default=0.999,
                   help="Adam's second-moment decay")
    g.add_argument("--adam-eps", type=float, default=1e-8,
                   help="Adam's epsilon")
    g.add_argument("--bf16", action="store_true",
                   help="train in bfloat16 with fp32 master weights")
    g.add_argument("--fp16", action="store_true",
                   help="train in float16 with fp32 master weights and loss scaling")
    g.add_argument("--loss-scale", type=float, default=None, help="static loss scale of --fp16 (default: dynamic) or --bf16 (default: none), "
                   "as Megatron-LM")
    g.add_argument("--initial-loss-scale", type=float, default=2.0 ** 16,
                   help="--fp16's dynamic loss scale at the start (rounded down to a power of 2)")
    g.add_argument("--loss-scale-window", type=int, default=1000,
                   help="steps without overflow before the dynamic loss scale doubles")
    g.add_argument("--min-loss-scale", type=float, default=1.0,
                   help="the dynamic loss scale's floor")
    g.add_argument("--hysteresis", type=int, default=2,
                   help="overflows tolerated before the dynamic loss scale halves")
    g = p.add_argument_group("ZeRO and offload")
    g.add_argument("--zero-stage", type=int, default=1, choices=[0, 1, 2, 3],
                   help="ZeRO stage: 0 replicated optimizer, 1 optimizer state, 2 also gradients, 3 also parameters partitioned over DP")
    g.add_argument("--cpu-optimizer", "--zero-cpu-offload", dest="offload", action="store_const", const="cpu",
                   default="none", help="keep fp32 masters and Adam state in host memory (ZeRO-Offload)")
    g.add_argument("--zero-param-persistence-threshold", type=int, default=100_000,
                   help="ZeRO-3: parameters of at most this many elements stay gathered (DeepSpeed's "
                        "stage3_param_persistence_threshold; 0 gathers every parameter per layer)")
    g.add_argument("--zero-nvme-offload-path", type=str, default=None,
                   help="keep optimizer state in files under this path (ZeRO-Infinity style)")
    g.add_argument("--use-distributed-optimizer", action="store_true",
                   help="Megatron's distributed optimizer: ZeRO-1 (the default --zero-stage)")
    g.add_argument("--overlap-grad-reduce", action="store_true",
                   help="ZeRO 0-2: reduce gradient buckets asynchronously during backward")
    g.add_argument("--overlap-param-gather", action="store_true", default=None,
                   help="ZeRO 1/2: all-gather updated weights asynchronously, waited on at first use; "
                        "ZeRO-3: prefetch the next layer (on by default there, as in DeepSpeed)")
    g.add_argument("--zero-quantized-weights", action="store_true",
                   help="ZeRO++ qwZ (ZeRO-3): all-gather weights as int8 blocks (DeepSpeed's zero_quantized_weights)")
    g.add_argument("--zero-quantized-gradients", action="store_true",
                   help="ZeRO++ qgZ (ZeRO-3): reduce-scatter gradients as int8 blocks (zero_quantized_gradients)")
    g.add_argument("--zero-hpz-partition-size", type=int, default=1,
                   help="ZeRO++ hpZ (ZeRO-3): backward re-gathers weights within blocks of this many DP ranks "
                        "(zero_hpz_partition_size; 1: off)")
    g.add_argument("--grad-reduce-in-bf16", action="store_true",
                   help="ZeRO 0-2 and the tied-embedding sum: reduce gradients in bfloat16 (half the bytes); "
                        "micro-batches are still accumulated in fp32")
    g.add_argument("--cpu-optimizer-threads", type=int, default=None,
                   help="threads of the offloaded optimizer step (--cpu-optimizer, --zero-nvme-offload-path); "
                        "default: this rank's share of the node's cores (its CPU affinity / ranks per node)")
    g.add_argument("--deepspeed-config", "--deepspeed_config", dest="deepspeed_config", type=str, default=None,
                   help="a DeepSpeed JSON whose batch sizes, ZeRO, precision, optimizer and scheduler settings fill the flags not given")
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
