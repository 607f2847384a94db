"""Where Megatron-LM keeps its checkpoints, and which format one is in.

    <save>/latest_checkpointed_iteration.txt     the iteration, or `release`
    <save>/iter_{N:07d}/ (or release/)           one checkpoint:
        torch_dist:  .metadata, __R_T.distcp, common.pt, metadata.json   (Megatron-Core dist_checkpointing)
        torch:       mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt          (legacy, one file per model-parallel rank)

    found = find_megatron_checkpoint(path)   # (directory, format) or None when `path` is not Megatron-LM's

Our own save directories also write latest_checkpointed_iteration.txt (next to `latest` and global_stepN/):
they are not Megatron-LM's, and this finds nothing in them.
"""
from __future__ import annotations

import os
import re
from typing import Optional, Tuple

from ..errors import CheckpointError
from ..format import LATEST, LATEST_ITERATION

TORCH_DIST, LEGACY = "torch_dist", "torch"
LEGACY_DIR = re.compile(r"^mp_rank_(\d\d)(?:_(\d\d\d))?(?:_(\d\d\d))?$")
LEGACY_FILE = "model_optim_rng.pt"


def checkpoint_format(directory: str) -> Optional[str]:
    """'torch_dist' or 'torch' (legacy) for one Megatron-LM checkpoint directory, else None."""
    if not os.path.isdir(directory):
        return None
    names = os.listdir(directory)
    if ".metadata" in names and "common.pt" in names:
        return TORCH_DIST
    if any(LEGACY_DIR.match(n) and os.path.isfile(os.path.join(directory, n, LEGACY_FILE)) for n in names):
        return LEGACY
    return None


def iteration_dir(save_dir: str) -> Optional[str]:
    """The checkpoint latest_checkpointed_iteration.txt names in a Megatron-LM save directory, else None."""
    tracker = os.path.join(save_dir, LATEST_ITERATION)
    if not os.path.isfile(tracker) or os.path.isfile(os.path.join(save_dir, LATEST)):
        return None  # no tracker, or our own save directory (it has `latest`)
    with open(tracker) as f:
        text = f.read().strip()
    if text == "release":
        return os.path.join(save_dir, "release")
    if not text.isdigit():
        return None
    directory = os.path.join(save_dir, f"iter_{int(text):07d}")
    return directory if os.path.isdir(directory) else None  # ours write the tracker too (global_stepN/)


def find_megatron_checkpoint(path: str) -> Optional[Tuple[str, str]]:
    """(checkpoint directory, format) when `path` is a Megatron-LM save directory or one of its checkpoints."""
    if not os.path.isdir(path):
        return None
    kind = checkpoint_format(path)
    if kind:
        return os.path.normpath(path), kind
    directory = iteration_dir(path)
    if directory is None:
        return None
    kind = checkpoint_format(directory)
    if kind is None:
        raise CheckpointError(f"{directory} (named by {os.path.join(path, LATEST_ITERATION)}) holds neither a "
                              f"torch_dist checkpoint (.metadata, common.pt) nor legacy mp_rank_*/{LEGACY_FILE} files")
    return directory, kind
