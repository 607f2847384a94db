"""The logging flags (log lines, TensorBoard, timers, MFU, Weights & Biases): their checks, and
--wandb-save-dir's default under --save."""
from __future__ import annotations

import argparse
import importlib
import os

from .errors import require


def add_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("logging")
    g.add_argument("--log-interval", type=int, default=100,
                   help="steps between log lines")
    g.add_argument("--tensorboard-dir", type=str, default=None,
                   help="directory TensorBoard event files are written to (rank 0)")
    g.add_argument("--log-params-norm", action="store_true", help="log the L2 norm of the weights (a collective)")
    g.add_argument("--log-memory-to-tensorboard", action="store_true",
                   help="write the device's memory statistics to TensorBoard")
    g.add_argument("--log-world-size-to-tensorboard", action="store_true",
                   help="write the world size to TensorBoard")
    g.add_argument("--log-timers-to-tensorboard", action="store_true",
                   help="write the --timing-log-level timers to TensorBoard")
    g.add_argument("--timing-log-level", type=int, default=0, choices=[0, 1, 2],
                   help="0: no timers; 1: forward-backward and optimizer; 2: also forward, backward, communication")
    g.add_argument("--timing-log-option", choices=["max", "minmax", "all"], default="minmax",
                   help="timers over ranks: their maximum, their minimum and maximum, or every rank's")
    g.add_argument("--peak-tflops", type=float, default=None,
                   help="peak TFLOP/s of one device for the training dtype, for MFU (known for H100/H200/A100/V100)")
    g.add_argument("--wandb-project", type=str, default=None,
                   help="Weights & Biases project to log to (needs wandb)")
    g.add_argument("--wandb-exp-name", type=str, default=None,
                   help="the Weights & Biases run's name")
    g.add_argument("--wandb-save-dir", type=str, default=None, help="default: <--save>/wandb")


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
