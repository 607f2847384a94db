"""Megatron-LM and Megatron-DeepSpeed flags that launch scripts carry, with their meaning here.

`add_compat_flags(parser)` declares them; `validate_compat(args)` (a feature check of config.validate)
checks them and turns them into what the trainer reads (schedule units, batch limits). A flag whose
feature this build lacks is not declared here but refused in flag_refusals.py. A few are documented
no-ops: each says in --help why it changes nothing here (what it asks for is what happens anyway).
"""
from __future__ import annotations

import argparse
import math

from .config.errors import require


def _data_impl(text: str) -> str:
    if text not in ("mmap", "infer"):
        raise argparse.ArgumentTypeError(
            f"{text!r}: only Megatron's mmap .bin/.idx datasets are read here (--data-impl mmap or infer)")
    return text


def add_compat_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("Megatron-LM / Megatron-DeepSpeed compatibility (docs/coming_from_megatron.md)")
    g.add_argument("--deepspeed", action="store_true",
                   help="Megatron-DeepSpeed's switch for the DeepSpeed engine: ZeRO is always on here, so it says "
                        "that the --deepspeed_config JSON applies (required with it)")
    g.add_argument("--deepspeed-activation-checkpointing", action="store_true",
                   help="Megatron-DeepSpeed: recompute activations through DeepSpeed's checkpointing; here the "
                        "recompute of --checkpoint-activations / --recompute-granularity, which it needs")
    g.add_argument("--no-pipeline-parallel", action="store_true",
                   help="Megatron-DeepSpeed: the model without pipeline stages; needs --pipeline-model-parallel-size 1")
    g.add_argument("--data-impl", type=_data_impl, default="mmap", help="mmap or infer: Megatron's .bin/.idx")
    g.add_argument("--no-query-key-layer-scaling", dest="apply_query_key_layer_scaling", action="store_false",
                   help="no-op: attention scores are never scaled by the layer number here (softmax in fp32)")
    g.add_argument("--use-mcore-models", action="store_true",
                   help="no-op: there is one GPT implementation here (Megatron-Core's parameter layout)")
    g.add_argument("--no-create-attention-mask-in-dataloader", dest="create_attention_mask_in_dataloader",
                   action="store_false", help="no-op: the causal mask is never materialised in the data here")
    g.add_argument("--calculate-per-token-loss", action="store_true",
                   help="no-op: every micro-batch counts seq-length x micro-batch-size tokens (no loss mask), so "
                        "the per-token and per-micro-batch averages are the same number")
    g.add_argument("--log-throughput", action="store_true",
                   help="no-op: the log line always carries throughput per GPU (TFLOP/s/GPU) here")
    g.add_argument("--no-position-embedding", dest="add_position_embedding", action="store_false",
                   help="no learned absolute position table: with --position-embedding-type rope, as here always")
    g.add_argument("--ds-sequence-parallel-size", type=int, default=1,
                   help="Megatron-DeepSpeed's DeepSpeed-Ulysses degree: context parallelism with --cp-comm-type a2a "
                        "(the same head-scattering all-to-all) over this many ranks")
    g.add_argument("--train-tokens", type=int, default=None,
                   help="Megatron-DeepSpeed: stop once this many tokens are consumed (global batch x seq-length a step)")
    g.add_argument("--lr-warmup-tokens", type=int, default=None, help="warm-up length in tokens (token schedule)")
    g.add_argument("--lr-decay-tokens", type=int, default=None, help="decay length in tokens (token schedule)")
    g.add_argument("--lr-warmup-samples", type=int, default=0, help="warm-up length in samples (sample schedule)")
    g.add_argument("--lr-decay-samples", type=int, default=None, help="decay length in samples (sample schedule)")
    g.add_argument("--lr-warmup-fraction", type=float, default=None,
                   help="warm-up as a fraction of the decay length (instead of --lr-warmup-iters / -samples)")
    g.add_argument("--tensorboard-queue-size", type=int, default=100,
                   help="events TensorBoard's writer holds before it writes them to disk")
    g.add_argument("--log-batch-size-to-tensorboard", action="store_true",
                   help="no-op: the batch-size scalar is always written here (as Megatron-LM does)")
    g.add_argument("--log-validation-ppl-to-tensorboard", action="store_true",
                   help="no-op: lm loss validation ppl is always written beside the loss here (as Megatron-LM does)")
    g.add_argument("--manual-gc", action="store_true",
                   help="turn Python's automatic garbage collection off and collect at evaluation, at saves and "
                        "every --manual-gc-interval iterations (same on every rank, no straggler)")
    g.add_argument("--manual-gc-interval", type=int, default=0, help="iterations between collections (0: never)")
    g.add_argument("--empty-unused-memory-level", type=int, default=0, choices=[0, 1, 2],
                   help="return the allocator's cached device memory after each step (1) and also after "
                        "forward-backward (2); the CPU has no such cache")
    g.add_argument("--num-workers", type=int, default=0,
                   help="threads reading the next global batch while this one trains (0: read in line)")
    g.add_argument("--no-mmap-bin-files", dest="mmap_bin_files", action="store_false",
                   help="read .bin token files with plain reads instead of mapping them")
    g.add_argument("--mock-data", action="store_true",
                   help="train on synthetic token sequences (Megatron's mock dataset) instead of --data-path")
    g.add_argument("--no-save-optim", action="store_true",
                   help="checkpoints hold the weights (model files and the fp32 master partitions) without the "
                        "Adam moments, step and loss scale; --load of one starts a fresh optimizer at iteration 0")
    g.add_argument("--no-save-rng", action="store_true", help="checkpoints hold no RNG states")
    g.add_argument("--save-weights-interval", type=int, default=None,
                   help="also save weights only (as --no-save-optim) every N iterations, under <--save>/weights_only "
                        "(its own latest), beside the full saves of --save-interval")
    g.add_argument("--profile", action="store_true",
                   help="torch.profiler trace of iterations --profile-step-start to --profile-step-end, written "
                        "under --tensorboard-dir (TensorBoard's profiler plugin reads it)")
    g.add_argument("--profile-step-start", type=int, default=10,
                   help="the first profiled iteration")
    g.add_argument("--profile-step-end", type=int, default=12,
                   help="the iteration the profiler stops before")
    g.add_argument("--profile-ranks", type=int, nargs="+", default=[0], help="global ranks that profile")


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


def lr_increment(args, global_batch_size: int) -> int:
    """What one optimizer step adds to the schedule's count, in its unit, at this step's global batch."""
    unit = getattr(args, "lr_schedule_unit", "iterations")
    return {"iterations": 1, "samples": global_batch_size,
            "tokens": global_batch_size * args.seq_length}[unit]
