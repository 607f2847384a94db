"""The logging flags (log lines, TensorBoard, timers, MFU, Weights & Biases): their checks, and
--wandb-save-dir's default under --save."""
from __future__ import annotations

import argparse
import importlib
import os
from typing import Optional

from .errors import require
from .fields import add_section_flags, flag, section


@section("logging")
class LogConfig:
    """Log lines, TensorBoard, timers, MFU and Weights & Biases, checked."""
    log_interval: int = flag("steps between log lines", 100)
    tensorboard_dir: Optional[str] = flag("directory TensorBoard event files are written to (rank 0)")
    log_params_norm: bool = flag("log the L2 norm of the weights (a collective)", False, action="store_true")
    log_memory_to_tensorboard: bool = flag("write the device's memory statistics to TensorBoard", False,
                                           action="store_true")
    log_world_size_to_tensorboard: bool = flag("write the world size to TensorBoard", False, action="store_true")
    log_timers_to_tensorboard: bool = flag("write the --timing-log-level timers to TensorBoard", False,
                                           action="store_true")
    timing_log_level: int = flag("0: no timers; 1: forward-backward and optimizer; 2: also forward, backward, "
                                 "communication", 0, choices=[0, 1, 2])
    timing_log_option: str = flag("timers over ranks: their maximum, their minimum and maximum, or every rank's",
                                  "minmax", choices=["max", "minmax", "all"])
    peak_tflops: Optional[float] = flag("peak TFLOP/s of one device for the training dtype, for MFU (known for "
                                        "H100/H200/A100/V100)")
    wandb_project: Optional[str] = flag("Weights & Biases project to log to (needs wandb)")
    wandb_exp_name: Optional[str] = flag("the Weights & Biases run's name")
    # <--save>/wandb by the check where not given
    wandb_save_dir: Optional[str] = flag("default: <--save>/wandb")


def add_flags(p: argparse.ArgumentParser) -> None:
    add_section_flags(p, LogConfig)


def check(args) -> None:
    require(args.peak_tflops is None or args.peak_tflops > 0, f"--peak-tflops {args.peak_tflops} must be positive")
    if args.wandb_project is None:
        require(args.wandb_exp_name is None and args.wandb_save_dir is None,
                "--wandb-exp-name / --wandb-save-dir are given without --wandb-project; name the project")
        return
    require(_importable("wandb"),
            f"--wandb-project {args.wandb_project} needs the wandb package, which is not installed (pip install wandb)")
    require(bool(args.wandb_exp_name), "--wandb-project needs --wandb-exp-name (the run's name)")
    if args.wandb_save_dir is None:
        require(args.save is not None, "--wandb-project needs --wandb-save-dir (or --save, to write under <save>/wandb)")
        args.wandb_save_dir = os.path.join(args.save, "wandb")


def _importable(module: str) -> bool:
    try:
        importlib.import_module(module)
        return True
    except ImportError:
        return False
