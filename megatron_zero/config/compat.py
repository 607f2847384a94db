"""Megatron-LM and Megatron-DeepSpeed flags that launch scripts carry, with their meaning here.

CompatConfig's fields declare them; `validate_compat(args)` (a feature check of config.validate)
checks them and turns them into what the trainer reads (schedule units, batch limits). A flag whose
feature this build lacks is not declared here but refused in arguments/flag_refusals.py. A few are documented
no-ops: each says in --help why it changes nothing here (what it asks for is what happens anyway).
"""
from __future__ import annotations

import argparse
import math
from typing import List, Optional

from .errors import require
from .fields import add_section_flags, derived, flag, section


def _data_impl(text: str) -> str:
    if text not in ("mmap", "infer"):
        raise argparse.ArgumentTypeError(
            f"{text!r}: only Megatron's mmap .bin/.idx datasets are read here (--data-impl mmap or infer)")
    return text


@section("Megatron-LM / Megatron-DeepSpeed compatibility (docs/coming_from_megatron.md)")
class CompatConfig:
    """The flags launch scripts carry, with their meaning here; validate_compat derives the schedule's units."""
    deepspeed: bool = flag("Megatron-DeepSpeed's switch for the DeepSpeed engine: ZeRO is always on here, so it says "
                           "that the --deepspeed_config JSON applies (required with it)", False, action="store_true")
    deepspeed_activation_checkpointing: bool = flag(
        "Megatron-DeepSpeed: recompute activations through DeepSpeed's checkpointing; here the recompute of "
        "--checkpoint-activations / --recompute-granularity, which it needs", False, action="store_true")
    no_pipeline_parallel: bool = flag("Megatron-DeepSpeed: the model without pipeline stages; needs "
                                      "--pipeline-model-parallel-size 1", False, action="store_true")
    data_impl: str = flag("mmap or infer: Megatron's .bin/.idx", "mmap", type=_data_impl)
    apply_query_key_layer_scaling: bool = flag("no-op: attention scores are never scaled by the layer number here "
                                               "(softmax in fp32)", True, names=("--no-query-key-layer-scaling",),
                                               action="store_false")
    use_mcore_models: bool = flag("no-op: there is one GPT implementation here (Megatron-Core's parameter layout)",
                                  False, action="store_true")
    create_attention_mask_in_dataloader: bool = flag(
        "no-op: the causal mask is never materialised in the data here", True,
        names=("--no-create-attention-mask-in-dataloader",), action="store_false")
    calculate_per_token_loss: bool = flag(
        "no-op: every micro-batch counts seq-length x micro-batch-size tokens (no loss mask), so the per-token and "
        "per-micro-batch averages are the same number", False, action="store_true")
    log_throughput: bool = flag("no-op: the log line always carries throughput per GPU (TFLOP/s/GPU) here", False,
                                action="store_true")
    add_position_embedding: bool = flag("no learned absolute position table: with --position-embedding-type rope, as "
                                        "here always", True, names=("--no-position-embedding",), action="store_false")
    ds_sequence_parallel_size: int = flag("Megatron-DeepSpeed's DeepSpeed-Ulysses degree: context parallelism with "
                                          "--cp-comm-type a2a (the same head-scattering all-to-all) over this many "
                                          "ranks", 1)
    train_tokens: Optional[int] = flag("Megatron-DeepSpeed: stop once this many tokens are consumed (global batch x "
                                       "seq-length a step)")
    lr_warmup_tokens: Optional[int] = flag("warm-up length in tokens (token schedule)")
    lr_decay_tokens: Optional[int] = flag("decay length in tokens (token schedule)")
    lr_warmup_samples: int = flag("warm-up length in samples (sample schedule)", 0)
    lr_decay_samples: Optional[int] = flag("decay length in samples (sample schedule)")
    lr_warmup_fraction: Optional[float] = flag("warm-up as a fraction of the decay length (instead of "
                                               "--lr-warmup-iters / -samples)")
    tensorboard_queue_size: int = flag("events TensorBoard's writer holds before it writes them to disk", 100)
    log_batch_size_to_tensorboard: bool = flag("no-op: the batch-size scalar is always written here (as Megatron-LM "
                                               "does)", False, action="store_true")
    log_validation_ppl_to_tensorboard: bool = flag("no-op: lm loss validation ppl is always written beside the loss "
                                                   "here (as Megatron-LM does)", False, action="store_true")
    manual_gc: bool = flag("turn Python's automatic garbage collection off and collect at evaluation, at saves and "
                           "every --manual-gc-interval iterations (same on every rank, no straggler)", False,
                           action="store_true")
    manual_gc_interval: int = flag("iterations between collections (0: never)", 0)
    empty_unused_memory_level: int = flag("return the allocator's cached device memory after each step (1) and also "
                                          "after forward-backward (2); the CPU has no such cache", 0,
                                          choices=[0, 1, 2])
    num_workers: int = flag("threads reading the next global batch while this one trains (0: read in line)", 0)
    mmap_bin_files: bool = flag("read .bin token files with plain reads instead of mapping them", True,
                                names=("--no-mmap-bin-files",), action="store_false")
    mock_data: bool = flag("train on synthetic token sequences (Megatron's mock dataset) instead of --data-path",
                           False, action="store_true")
    no_save_optim: bool = flag("checkpoints hold the weights (model files and the fp32 master partitions) without "
                               "the Adam moments, step and loss scale; --load of one starts a fresh optimizer at "
                               "iteration 0", False, action="store_true")
    no_save_rng: bool = flag("checkpoints hold no RNG states", False, action="store_true")
    save_weights_interval: Optional[int] = flag("also save weights only (as --no-save-optim) every N iterations, "
                                                "under <--save>/weights_only (its own latest), beside the full saves "
                                                "of --save-interval")
    profile: bool = flag("torch.profiler trace of iterations --profile-step-start to --profile-step-end, written "
                         "under --tensorboard-dir (TensorBoard's profiler plugin reads it)", False, action="store_true")
    profile_step_start: int = flag("the first profiled iteration", 10)
    profile_step_end: int = flag("the iteration the profiler stops before", 12)
    profile_ranks: List[int] = flag("global ranks that profile", [0], nargs="+")
    lr_schedule_unit: str = derived("the learning-rate schedule's unit: iterations, samples or tokens "
                                    "(validate_compat)")
    lr_schedule_per_step: int = derived("what a step at the configured global batch adds to the schedule's count")
    lr_schedule_warmup: float = derived("the warm-up length in the schedule's unit (a float with "
                                        "--lr-warmup-fraction)")
    lr_schedule_decay: int = derived("the decay length in the schedule's unit")
    lr_schedule_wsd_decay: Optional[int] = derived("WSD's decay length in the schedule's unit, or None")


def add_flags(p: argparse.ArgumentParser) -> None:
    add_section_flags(p, CompatConfig)


def validate_compat(args) -> None:
    """Check the compatibility flags and derive what the trainer reads: `lr_schedule_unit`
    (iterations, samples or tokens: the unit of warm-up, decay and the schedule's step count; each
    step adds 1, its global batch, or its global batch x --seq-length: `lr_increment`)."""
    require(not args.deepspeed or args.deepspeed_config,
            "--deepspeed switches on the DeepSpeed engine, whose settings here come from --deepspeed_config; "
            "give the JSON (or drop --deepspeed)")
    require(not args.deepspeed_activation_checkpointing or args.recompute_granularity is not None,
            "--deepspeed-activation-checkpointing says how activations are recomputed and needs "
            "--checkpoint-activations or --recompute-granularity")
    require(not args.no_pipeline_parallel or args.pipeline_model_parallel_size == 1,
            f"--no-pipeline-parallel contradicts --pipeline-model-parallel-size {args.pipeline_model_parallel_size}"
            "; drop one of them")
    require(args.add_position_embedding or args.position_embedding_type == "rope",
            "--no-position-embedding leaves no position information without --position-embedding-type rope")
    require(args.manual_gc_interval >= 0, f"--manual-gc-interval {args.manual_gc_interval} must not be negative")
    require(args.manual_gc or not args.manual_gc_interval, "--manual-gc-interval needs --manual-gc")
    require(args.num_workers >= 0, f"--num-workers {args.num_workers} must not be negative")
    require(args.tensorboard_queue_size >= 1, f"--tensorboard-queue-size {args.tensorboard_queue_size} must be >= 1")
    require(not (args.mock_data and args.data_path),
            "--mock-data trains on synthetic tokens and --data-path on a dataset; give one of them")
    require(args.save_weights_interval is None or (args.save_weights_interval >= 1 and args.save),
            f"--save-weights-interval {args.save_weights_interval} needs --save and must be at least 1")
    require(not ((args.no_save_optim or args.no_save_rng) and not args.save),
            "--no-save-optim / --no-save-rng say what checkpoints hold; give --save")
    if args.profile:
        require(args.tensorboard_dir is not None,
                "--profile writes its trace under --tensorboard-dir; give one")
        require(0 <= args.profile_step_start < args.profile_step_end,
                f"--profile-step-start {args.profile_step_start} must be below --profile-step-end "
                f"{args.profile_step_end}")
    _schedule_units(args)


def _schedule_units(args) -> None:
    gbs, seq = args.global_batch_size, args.seq_length
    if args.train_tokens is not None:
        require(args.train_tokens > 0, f"--train-tokens {args.train_tokens} must be positive")
        schedule = getattr(args, "batch_schedule", None)
        args.train_iters = min(args.train_iters, schedule.train_iters(-(-args.train_tokens // seq))
                               if schedule is not None and schedule.varies else
                               math.ceil(args.train_tokens / (gbs * seq)))
    tokens = args.lr_warmup_tokens is not None or args.lr_decay_tokens is not None
    samples = args.lr_warmup_samples or args.lr_decay_samples is not None
    require(not (tokens and samples), "the learning-rate schedule is in tokens (--lr-*-tokens) or in samples "
            "(--lr-*-samples), not both")
    require(not samples or args.train_samples is not None,
            "--lr-warmup-samples / --lr-decay-samples need --train-samples (a sample-based run)")
    require(not (args.lr_warmup_fraction is not None and (args.lr_warmup_iters or args.lr_warmup_samples
                                                           or args.lr_warmup_tokens)),
            "--lr-warmup-fraction replaces --lr-warmup-iters / -samples / -tokens; give one of them")
    if getattr(args, "deepspeed_scheduler", None) is not None:  # the JSON's scheduler counts optimizer steps
        require(not (tokens or samples or args.lr_warmup_fraction is not None),
                "the --deepspeed_config JSON's scheduler replaces --lr-*-tokens, --lr-*-samples and "
                "--lr-warmup-fraction; give one or the other")
        args.lr_schedule_unit, args.lr_schedule_per_step = "iterations", 1
        args.lr_schedule_warmup, args.lr_schedule_decay = args.lr_warmup_iters, args.lr_decay_iters
        args.lr_schedule_wsd_decay = None  # the JSON's schedule has no WSD
        return
    if tokens:
        args.lr_schedule_unit, per_step = "tokens", gbs * seq
        decay = args.lr_decay_tokens if args.lr_decay_tokens is not None else args.lr_decay_iters * per_step
        warmup = args.lr_warmup_tokens if args.lr_warmup_tokens is not None else args.lr_warmup_iters * per_step
    elif (samples or args.train_samples is not None or args.lr_warmup_fraction is not None
          or getattr(args, "batch_schedule", None) is not None and args.batch_schedule.varies):
        # a global batch that grows (batch_schedule.py): Megatron counts the schedule in samples
        args.lr_schedule_unit, per_step = "samples", gbs
        decay = (args.lr_decay_samples if args.lr_decay_samples is not None else
                 args.train_samples if args.train_samples is not None and args.lr_decay_iters == args.train_iters
                 else args.lr_decay_iters * gbs)
        warmup = args.lr_warmup_samples or args.lr_warmup_iters * gbs
    else:
        args.lr_schedule_unit, per_step, decay, warmup = "iterations", 1, args.lr_decay_iters, args.lr_warmup_iters
    if args.lr_warmup_fraction is not None:
        require(0 <= args.lr_warmup_fraction <= 1, f"--lr-warmup-fraction {args.lr_warmup_fraction} must lie in [0, 1]")
        warmup = args.lr_warmup_fraction * decay  # a float, as Megatron-LM's lr_warmup_steps
    args.lr_schedule_per_step, args.lr_schedule_warmup, args.lr_schedule_decay = per_step, warmup, decay
    # WSD's decay length in the schedule's unit (per_step of it a step, gbs samples a step)
    args.lr_schedule_wsd_decay = (args.lr_wsd_decay_iters * per_step if args.lr_wsd_decay_iters is not None else
                                  args.lr_wsd_decay_samples * per_step // gbs if args.lr_wsd_decay_samples is not None
                                  else None)
    require(args.lr_schedule_wsd_decay is None or args.lr_schedule_wsd_decay <= decay,
            f"WSD's decay ({args.lr_schedule_wsd_decay} {args.lr_schedule_unit}) is longer than the whole decay span "
            f"({decay}); shorten --lr-wsd-decay-iters / --lr-wsd-decay-samples")


def lr_increment(unit: str, global_batch_size: int, seq_length: int) -> int:
    """What one optimizer step adds to the schedule's count in its `unit` (CompatConfig.lr_schedule_unit), at
    this step's global batch."""
    return {"iterations": 1, "samples": global_batch_size, "tokens": global_batch_size * seq_length}[unit]
