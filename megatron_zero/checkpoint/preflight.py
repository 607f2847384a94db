"""Checks on --save before the first iteration, so a bad path or a full disk is found before the training.

    check_save_dir(save_dir, checkpoint_bytes, saves_planned, keep_last_k)   # rank 0; raises or warns

- writable: the directory is created if missing, and a probe file is written, fsynced and removed
  (a file in the path, a read-only filesystem, no permission: one sentence naming the path);
- leftovers of crashed saves (`<tag>.tmp-*`, `<tag>.old-*`) are removed, saying how many bytes that freed;
- room: fewer free bytes than one checkpoint is an error; fewer than the checkpoints this run will
  keep at once is a warning. Both give the two numbers.
"""
from __future__ import annotations

import os
import shutil
import sys
from typing import Optional

from .storage.commit import remove_stale, stale_dirs
from .errors import CheckpointError


def checkpoint_bytes(num_params: int, weight_bytes: int) -> int:
    """About the size of one checkpoint: the weights once, and fp32 masters with two Adam moments."""
    return num_params * (weight_bytes + 12)


def _probe(save_dir: str) -> None:
    try:
        os.makedirs(save_dir, exist_ok=True)
        probe = os.path.join(save_dir, f".write-probe-{os.getpid()}")
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.write(fd, b"\0" * 4096)
            os.fsync(fd)
        finally:
            os.close(fd)
            os.remove(probe)
    except OSError as e:
        raise CheckpointError(f"--save {save_dir} is not writable ({e.strerror or e}"
                              f"{': ' + str(e.filename) if e.filename else ''}); give a directory this job "
                              "can create and write") from None


def _dir_bytes(path: str) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            try:
                total += os.path.getsize(os.path.join(root, f))
            except OSError:
                pass
    return total


def check_save_dir(save_dir: str, one_checkpoint: int, saves_planned: int, keep_last_k: Optional[int]) -> None:
    """Raise CheckpointError for an unwritable --save or one without room for a checkpoint; warn when the
    checkpoints this run keeps at once will not fit."""
    _probe(save_dir)
    stale = stale_dirs(save_dir)
    if stale:
        freed = sum(_dir_bytes(p) for p in stale)
        remove_stale(save_dir, keep_tmp=None)
        print(f"removed {len(stale)} leftover director{'y' if len(stale) == 1 else 'ies'} of interrupted saves "
              f"from --save {save_dir} ({freed} bytes)", file=sys.stderr, flush=True)
    free = shutil.disk_usage(save_dir).free
    if free < one_checkpoint:
        raise CheckpointError(f"--save {save_dir} has {free} bytes free but one checkpoint of this model takes "
                              f"about {one_checkpoint} bytes; free space there or point --save elsewhere")
    kept = min(saves_planned, keep_last_k or saves_planned) + (1 if keep_last_k else 0)  # the next one is written
    if free < kept * one_checkpoint:                                                    # before the oldest goes
        print(f"warning: --save {save_dir} has {free} bytes free but this run keeps up to {kept} checkpoints of "
              f"about {one_checkpoint} bytes each ({kept * one_checkpoint} bytes); later saves will fail unless "
              "space is freed or --keep-last-k is lowered", file=sys.stderr, flush=True)
