"""The training run's flags: its length (iterations or samples), the learning-rate schedule's shape, the
stop rules (skipped steps, NaN, exit interval, duration and signals), the seed and evaluation."""
from __future__ import annotations

import argparse
from typing import Optional

from ..model.config import GPTConfig
from .errors import require
from .fields import add_section_flags, flag, section


@section("training length, learning-rate schedule, stop rules")
class TrainingConfig:
    """The run's length, the learning-rate schedule's shape, the stop rules, the seed and evaluation, checked."""
    # --train-samples' runs: derived from the batch schedule by check_length
    train_iters: Optional[int] = flag("optimizer steps to train for (or --train-samples)")
    train_samples: Optional[int] = flag("samples to train on (or --train-iters); the step count follows from the "
                                        "global batch")
    lr_decay_style: str = flag("the learning rate's decay after warm-up, Megatron-LM's formulas (WSD: stable at --lr "
                               "until its last --lr-wsd-decay-iters)", "linear",
                               choices=["constant", "linear", "cosine", "WSD", "inverse-square-root"])
    lr_wsd_decay_style: str = flag("WSD's decay shape over its last steps", "exponential",
                                   choices=["exponential", "linear", "cosine", "minus_sqrt"])
    lr_wsd_decay_iters: Optional[int] = flag("WSD: the steps at the end of the decay span that decay the learning "
                                             "rate (iteration-based runs)")
    lr_wsd_decay_samples: Optional[int] = flag("WSD: the samples at the end of the decay span that decay the "
                                               "learning rate (sample-based runs)")
    lr_decay_iters: Optional[int] = flag("steps over which the learning rate decays (default --train-iters)")
    lr_warmup_iters: int = flag("steps of linear warm-up from 0 to --lr", 0)
    max_consecutive_skipped_iterations: int = flag(
        "stop the run (exit 2, nothing saved) after N optimizer steps in a row skipped for overflowing gradients; "
        "0: never (megatron_zero/training/stop_rules.py says why 50)", 50, metavar="N")
    check_for_nan_in_loss_and_grad: bool = flag(
        "stop the run (exit 2, nothing saved) on an inf/NaN loss, or inf/NaN gradients where the loss scale is not "
        "dynamic (the default)", True, action="store_true",
        also=(dict(names=("--no-check-for-nan-in-loss-and-grad",), action="store_false",
                   help="keep training through inf/NaN losses and gradients"),))
    seed: int = flag("random seed (weights, dropout, data order)", GPTConfig.seed)
    exit_interval: Optional[int] = flag("save (with --save) and stop after any step that is a multiple of this")
    exit_duration_in_mins: Optional[float] = flag("save (with --save) and stop once the run has lasted this many "
                                                  "minutes")
    exit_signal_handler: bool = flag("on SIGTERM or SIGUSR1 finish the step, save (with --save) and stop", False,
                                     action="store_true")
    eval_interval: int = flag("steps between validation runs", 1000)
    eval_iters: int = flag("validation batches per evaluation (0: no evaluation)", 10)


def add_flags(p: argparse.ArgumentParser) -> None:
    add_section_flags(p, TrainingConfig)


def check_stop_rules(args) -> None:
    require(args.max_consecutive_skipped_iterations >= 0, "--max-consecutive-skipped-iterations must be 0 "
            f"(never stop) or positive, got {args.max_consecutive_skipped_iterations}")


def check_length(args) -> None:
    """One of --train-iters and --train-samples (the step count then follows from the batch schedule)."""
    require((args.train_iters is None) != (args.train_samples is None),
            "give exactly one of --train-iters and --train-samples")
    if args.train_samples is not None:
        args.train_iters = args.batch_schedule.train_iters(args.train_samples)
    require(args.train_iters >= 0, f"--train-iters {args.train_iters} must not be negative")


def check_schedule(args) -> None:
    require(args.lr_warmup_iters >= 0, f"--lr-warmup-iters {args.lr_warmup_iters} must not be negative")
    wsd = (args.lr_wsd_decay_iters, args.lr_wsd_decay_samples)
    require(args.lr_decay_style != "WSD" or any(v is not None for v in wsd),
            "--lr-decay-style WSD decays over its last --lr-wsd-decay-iters (or --lr-wsd-decay-samples); give one")
    require(all(v is None or v > 0 for v in wsd), "--lr-wsd-decay-iters / --lr-wsd-decay-samples must be positive")
    if args.lr_decay_iters is None:
        args.lr_decay_iters = args.train_iters


def check_evaluation(args) -> None:
    require(args.log_interval >= 1 and args.eval_interval >= 1, "--log-interval and --eval-interval must be at least 1")
    require(args.eval_iters >= 0, f"--eval-iters {args.eval_iters} must not be negative")
