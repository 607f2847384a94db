"""The training run's flags: its length (iterations or samples), the learning-rate schedule's shape, the
stop rules (skipped steps, NaN, exit interval, duration and signals), the seed and evaluation."""
from __future__ import annotations

import argparse

from .errors import require


def add_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("training length, learning-rate schedule, stop rules")
    g.add_argument("--train-iters", type=int, default=None,
                   help="optimizer steps to train for (or --train-samples)")
    g.add_argument("--train-samples", type=int, default=None,
                   help="samples to train on (or --train-iters); the step count follows from the global batch")
    g.add_argument("--lr-decay-style", choices=["constant", "linear", "cosine"], default="linear",
                   help="the learning rate's decay after warm-up")
    g.add_argument("--lr-decay-iters", type=int, default=None,
                   help="steps over which the learning rate decays (default --train-iters)")
    g.add_argument("--lr-warmup-iters", type=int, default=0,
                   help="steps of linear warm-up from 0 to --lr")
    g.add_argument("--max-consecutive-skipped-iterations", type=int, default=50, metavar="N",
                   help="stop the run (exit 2, nothing saved) after N optimizer steps in a row skipped for "
                        "overflowing gradients; 0: never (megatron_zero/stop_rules.py says why 50)")
    g.add_argument("--check-for-nan-in-loss-and-grad", dest="check_for_nan_in_loss_and_grad", action="store_true",
                   default=True, help="stop the run (exit 2, nothing saved) on an inf/NaN loss, or inf/NaN "
                                      "gradients where the loss scale is not dynamic (the default)")
    g.add_argument("--no-check-for-nan-in-loss-and-grad", dest="check_for_nan_in_loss_and_grad",
                   action="store_false",
                   help="keep training through inf/NaN losses and gradients")
    g.add_argument("--seed", type=int, default=1234,
                   help="random seed (weights, dropout, data order)")
    g.add_argument("--exit-interval", type=int, default=None,
                   help="save (with --save) and stop after any step that is a multiple of this")
    g.add_argument("--exit-duration-in-mins", type=float, default=None,
                   help="save (with --save) and stop once the run has lasted this many minutes")
    g.add_argument("--exit-signal-handler", action="store_true",
                   help="on SIGTERM or SIGUSR1 finish the step, save (with --save) and stop")
    g.add_argument("--eval-interval", type=int, default=1000,
                   help="steps between validation runs")
    g.add_argument("--eval-iters", type=int, default=10,
                   help="validation batches per evaluation (0: no evaluation)")


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
    if args.lr_decay_iters is None:
        args.lr_decay_iters = args.train_iters


def check_evaluation(args) -> None:
    require(args.log_interval >= 1 and args.eval_interval >= 1, "--log-interval and --eval-interval must be at least 1")
    require(args.eval_iters >= 0, f"--eval-iters {args.eval_iters} must not be negative")
