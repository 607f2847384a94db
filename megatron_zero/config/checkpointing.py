"""The checkpointing flags (--save, --load and what a save writes or a load reads): their checks, and the
one rule for a --load directory that does not exist yet."""
from __future__ import annotations

import argparse
import os
from typing import Optional

from .errors import require
from .fields import add_field_flag, add_section_flags, flag, section


@section("checkpointing")
class CheckpointConfig:
    """Where checkpoints go and come from, and what a save writes or a load reads, checked."""
    save: Optional[str] = flag("directory checkpoints are written to")
    load: Optional[str] = flag("checkpoint directory to resume from (ours, Megatron-DeepSpeed's, Megatron-LM's, or "
                               "universal); equal to --save it may not exist yet")
    save_interval: Optional[int] = flag("steps between checkpoints (also one at the end)")
    keep_last_k: Optional[int] = flag("keep only the newest K checkpoints under --save")
    async_save: bool = flag("write checkpoints in a background thread while training goes on", False,
                            action="store_true")
    save_megatron_deepspeed_layout: bool = flag(
        "write checkpoints Megatron-DeepSpeed's own --load resumes at this layout: at PP 1 its "
        "--no-pipeline-parallel layout (weights nested in mp_rank_*'s module), at PP > 1 its pipeline engine's; its "
        "scheduler, RNG and loss-scaler state (docs/checkpoint_interop.md)", False, action="store_true")
    save_16bit_model: bool = flag(
        "each save also writes <tag>/model_16bit/*.safetensors: the consolidated model in the training dtype, bf16 "
        "when training in fp32 (DeepSpeed's zero_optimization.stage3_gather_16bit_weights_on_model_save)", False,
        action="store_true")
    universal_checkpoint: bool = flag("load --load as a universal checkpoint (any layout, ds_to_universal.py's "
                                      "format)", False, action="store_true")
    ckpt_format: Optional[str] = flag(
        "the format of the Megatron-LM checkpoint --load names (torch_dist: Megatron-Core's distributed checkpoint; "
        "torch: legacy mp_rank_* files); without it the format is detected. Saves are in this trainer's layout: "
        "tools/convert_checkpoint.py --to torch_dist converts them", choices=("torch_dist", "torch"))
    ckpt_step: Optional[int] = flag("resume the checkpoint of this iteration under --load (global_stepN) instead of "
                                    "the one `latest` names")
    no_load_optim: bool = flag("load the weights but not the optimizer state", False, action="store_true")
    no_load_rng: bool = flag("do not restore the random number generators' states", False, action="store_true")
    finetune: bool = flag("load the weights only: fresh optimizer, schedule and iteration 0", False,
                          action="store_true")
    override_opt_param_scheduler: bool = flag(
        "on --load, take the learning-rate schedule (--lr, --min-lr, warm-up, decay length and style) from the flags "
        "even where the checkpoint's differs (only its step count is restored)", False, action="store_true",
        names=("--override-opt_param-scheduler", "--override-opt-param-scheduler"))
    use_checkpoint_opt_param_scheduler: bool = flag(
        "on --load, take the learning-rate schedule from the checkpoint, whatever the flags say", False,
        action="store_true", names=("--use-checkpoint-opt_param-scheduler", "--use-checkpoint-opt-param-scheduler"))
    overwrite_checkpoints: bool = flag("start from scratch even though --save holds checkpoints (they are "
                                       "overwritten)", False, action="store_true")
    verify_checkpoint: bool = flag("read checkpoint files without checking them against the checkpoint's manifest "
                                   "(sizes and checksums); unpickling stays safe", True,
                                   names=("--no-verify-checkpoint", "--no_verify_checkpoint"), action="store_false")


def add_verify_flag(parser) -> None:
    """--no-verify-checkpoint (dest `verify_checkpoint`), the same on pretrain_gpt.py and every tool."""
    add_field_flag(parser, CheckpointConfig, "verify_checkpoint")


def add_flags(p: argparse.ArgumentParser) -> None:
    add_section_flags(p, CheckpointConfig)


def load_is_first_run(args) -> bool:
    """--load names the --save directory, which does not exist yet: the first run of a launch script, a fresh
    start (any other --load must be a directory)."""
    return bool(args.load) and args.save is not None and os.path.abspath(args.load) == os.path.abspath(args.save) \
        and not os.path.isdir(args.load)


def check(args) -> None:
    require(args.save_interval is None or args.save_interval >= 1, f"--save-interval {args.save_interval} must be at least 1")
    require(args.save_interval is None or args.save, "--save-interval is given without --save; say where checkpoints go")
    require(args.keep_last_k is None or args.keep_last_k >= 1, f"--keep-last-k {args.keep_last_k} must be >= 1")
    _check_megatron_deepspeed_layout(args)


def check_load(args) -> None:
    require(not args.load or os.path.isdir(args.load) or load_is_first_run(args), f"--load {args.load} is not a directory")


def _check_megatron_deepspeed_layout(args) -> None:
    """What --save-megatron-deepspeed-layout can write."""
    if not args.save_megatron_deepspeed_layout:
        return
    require(args.zero_stage < 3, "--save-megatron-deepspeed-layout writes ZeRO stage 0, 1 or 2 checkpoints, not --zero-stage 3")
    require(args.zero_stage > 0 or args.data_parallel_size == 1,
            "--save-megatron-deepspeed-layout at --zero-stage 0 needs DP=1 (Megatron-DeepSpeed without ZeRO keeps "
            "one optimizer state per model-parallel rank); use --zero-stage 1")
    require(not args.batch_schedule.varies,
            "--save-megatron-deepspeed-layout writes the learning-rate schedule from a constant global batch; "
            "with --rampup-batch-size or --step-batch-size-schedule save in the default layout")
    require(args.deepspeed_scheduler is None,
            "--save-megatron-deepspeed-layout writes Megatron's learning-rate schedule; the DeepSpeed JSON's "
            "`scheduler` has no counterpart there: give --lr-warmup-iters/--lr-decay-iters instead")
    require(not (args.apply_layernorm_1p and args.normalization == "RMSNorm"),
            "--save-megatron-deepspeed-layout with --apply-layernorm-1p needs --normalization LayerNorm: "
            "Megatron-DeepSpeed's RMSNorm ignores the switch and would read the zero-centred weights as gamma")
    require(args.num_experts is None,
            "--save-megatron-deepspeed-layout writes dense GPTs only; save an MoE model without it (DeepSpeed-MoE's "
            "file layout, which --load and tools/ds_to_universal.py read)")
