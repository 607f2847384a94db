"""The flags of a run that heals itself (megatron_zero/reliability/, docs/reliability.md), under Megatron-LM's
names: the re-run mode, the result checks beyond --check-for-nan-in-loss-and-grad (training.py's section owns
that one), the tracker file of rejected results, the iterations to skip and fault injection. Registered from
arguments/__init__.py (FEATURES); `check` is their one check."""
from __future__ import annotations

import argparse
import os
from typing import Optional, Tuple

from .errors import require
from .fields import add_section_flags, flag, section


@section("result validation and re-runs (docs/reliability.md)")
class RerunConfig:
    """What a step's results are checked for, and what a failed check does."""
    rerun_mode: str = flag(
        "validate_results: a step whose loss or gradient norm fails a check is re-run from the same state: a "
        "different result is a transient fault (the re-run's result kept), the same one on every rank a genuine "
        "anomaly (the step rejected and its global batch skipped), the same one on one rank only a persistent fault "
        "(the run stops, exit 17); report_stats: every step is run twice and the differences reported; disabled: "
        "only --check-for-nan-in-loss-and-grad's stop rule (exit 2). Megatron-LM defaults to validate_results, "
        "here disabled",
        "disabled", choices=["disabled", "validate_results", "report_stats"])
    check_for_spiky_loss: bool = flag(
        "a loss at least 10 times the largest of the last 100 accepted ones fails the check (Megatron-LM's factor; "
        "--spiky-loss-factor, --result-window change them)", False, action="store_true")
    check_for_large_grads: bool = flag(
        "a gradient norm at least 10 times the largest of the last 100 accepted ones fails the check (Megatron-LM's "
        "factor; --large-grads-factor, --result-window change them)", False, action="store_true")
    spiky_loss_factor: float = flag("--check-for-spiky-loss' factor over the window's largest loss", 10.0)
    large_grads_factor: float = flag("--check-for-large-grads' factor over the window's largest gradient norm", 10.0)
    result_window: int = flag("accepted steps the spike checks compare with; no step is checked for a spike before "
                              "the window is full (Megatron-LM's 100 samples)", 100)
    result_rejected_tracker_filename: Optional[str] = flag(
        "append one line per failed check and re-run to this file, in Megatron-LM's format; at start-up the "
        "iterations it shows rejected are skipped, as --iterations-to-skip")
    iterations_to_skip: Tuple[int, ...] = flag(
        "iterations (1-based, as logged) whose global batch is skipped: counted and consumed, not trained on",
        (), nargs="+", metavar="ITERATION")
    error_injection_rate: int = flag(
        "inject an error into about one step in this many, per rank (0: never); deterministic given --seed", 0)
    error_injection_type: str = flag(
        "what the injected error is: correct_result (a genuine anomaly every re-run reproduces), transient_error "
        "(gone on re-run), persistent_error (reproduced on the injecting rank only)", "transient_error",
        choices=["correct_result", "transient_error", "persistent_error"])


def add_flags(p: argparse.ArgumentParser) -> None:
    add_section_flags(p, RerunConfig)


def check(args) -> None:
    validating = args.rerun_mode != "disabled"
    require(not (args.error_injection_rate and not validating),
            f"--error-injection-rate {args.error_injection_rate} injects errors for the re-run machine to find: give "
            "--rerun-mode validate_results (or report_stats)")
    spikes = [f for f, on in (("--check-for-spiky-loss", args.check_for_spiky_loss),
                              ("--check-for-large-grads", args.check_for_large_grads)) if on]
    require(not spikes or args.rerun_mode == "validate_results",
            f"{' and '.join(spikes)} {'are' if len(spikes) > 1 else 'is'} checked by the re-run machine: give "
            f"--rerun-mode validate_results (with --rerun-mode {args.rerun_mode} nothing would check "
            f"{'them' if len(spikes) > 1 else 'it'})")
    require(args.error_injection_rate >= 0, f"--error-injection-rate {args.error_injection_rate} must be 0 (never) "
            "or positive")
    require(args.result_window >= 1, f"--result-window {args.result_window} must be at least 1")
    require(args.spiky_loss_factor > 1 and args.large_grads_factor > 1,
            "--spiky-loss-factor and --large-grads-factor must be above 1 (a multiple of the window's largest value)")
    require(all(i >= 1 for i in args.iterations_to_skip),
            f"--iterations-to-skip {' '.join(map(str, args.iterations_to_skip))}: iterations are counted from 1")
    tracker = args.result_rejected_tracker_filename
    require(tracker is None or os.path.isdir(os.path.dirname(os.path.abspath(tracker))),
            f"--result-rejected-tracker-filename {tracker}: its directory does not exist")
    require(not (validating and args.fp8_format is not None and args.fp8_recipe in (None, "delayed")),
            f"--rerun-mode {args.rerun_mode} re-runs steps, which would record FP8 delayed scaling's amaxes twice; "
            "use --fp8-recipe tensorwise (or another current-scaling recipe) with it")
    require(not (validating and args.moe_router_enable_expert_bias),
            f"--rerun-mode {args.rerun_mode} re-runs steps, which would count the tokens per expert twice and move "
            "--moe-router-enable-expert-bias's bias between a step and its re-run; drop one of the two")
    args.iterations_to_skip = tuple(sorted(set(args.iterations_to_skip)))
