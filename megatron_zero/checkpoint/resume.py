"""Which checkpoint a run resumes from, and the refusal to start from scratch over saved work.

    point = find_resume_point(load_dir)   # ResumePoint(directory, universal, note) or None (nothing saved)
    refuse_fresh_start_over(save_dir)     # a fresh start while --save holds checkpoints: one sentence

`--load` may name
  - a save directory with `latest`: the checkpoint it names;
  - a save directory without `latest` (a crash between the rename and `latest` on a first save)
    but with committed checkpoints: the newest whose every file verifies (said in `note`);
  - one checkpoint's own directory (`<save>/global_step6`), ZeRO or universal;
  - a directory with `latest_universal`, or asked for with universal=True: the universal checkpoint.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

from .commit import committed_tags, read_latest
from .errors import CheckpointError
from .format import LATEST, LATEST_UNIVERSAL, MODEL_FILE, ZERO3_MODEL_FILE
from .manifest import MANIFEST
from .reader import open_directory
from .universal_load import find_universal_dir


@dataclass
class ResumePoint:
    directory: str               # the checkpoint directory to read
    universal: bool = False
    note: Optional[str] = None   # one line for the log, when the choice needs saying


def _is_checkpoint_dir(path: str) -> bool:
    return os.path.isfile(os.path.join(path, MANIFEST)) or any(
        MODEL_FILE.match(f) or ZERO3_MODEL_FILE.match(f) for f in os.listdir(path))


def _newest_verified(load_dir: str, tags, verify: bool) -> ResumePoint:
    skipped = []
    for tag in reversed(tags):
        try:
            found = open_directory(os.path.join(load_dir, tag), verify)  # manifest read, every file at its size
            if found.manifest is not None:
                found.verify(sorted(found.manifest["files"]))  # and every checksum: a rare path, checked whole
        except CheckpointError as e:
            skipped.append(f"{tag} ({e})")
            continue
        what = "verified" if verify else "(unverified)"
        note = (f"--load {load_dir} has no `{LATEST}` file; resuming from its newest {what} checkpoint {tag}"
                + (f", skipping {'; '.join(skipped)}" if skipped else ""))
        return ResumePoint(os.path.join(load_dir, tag), note=note)
    raise CheckpointError(f"--load {load_dir} has no `{LATEST}` file and none of its checkpoints verifies: "
                          f"{'; '.join(skipped)}")


def find_resume_point(load_dir: str, universal: bool = False, verify: bool = True) -> Optional[ResumePoint]:
    """The checkpoint `--load load_dir` means, or None when it holds none (a fresh start)."""
    if not os.path.isdir(load_dir):
        raise CheckpointError(f"--load {load_dir} is not a directory")
    has_latest = os.path.isfile(os.path.join(load_dir, LATEST))
    if universal or (not has_latest and find_universal_dir(load_dir) is not None):
        directory = find_universal_dir(load_dir)
        if directory is None:
            raise CheckpointError(f"{load_dir} is not a universal checkpoint: it has neither zero/optimizer_state.pt "
                                  f"nor a {LATEST_UNIVERSAL} file; convert it with tools/ds_to_universal.py")
        return ResumePoint(directory, universal=True)
    if has_latest:
        directory = os.path.join(load_dir, read_latest(load_dir))
        if not os.path.isdir(directory):
            raise CheckpointError(f"the checkpoint directory {directory} (named by "
                                  f"{os.path.join(load_dir, LATEST)}) does not exist")
        return ResumePoint(directory)
    if _is_checkpoint_dir(load_dir):
        return ResumePoint(os.path.normpath(load_dir))
    tags = committed_tags(load_dir)
    return _newest_verified(load_dir, tags, verify) if tags else None


def refuse_fresh_start_over(save_dir: str) -> None:
    """Refuse a run that starts from scratch while `save_dir` holds checkpoints it would overwrite."""
    if not os.path.isdir(save_dir):
        return
    tags = committed_tags(save_dir)
    if tags or os.path.isfile(os.path.join(save_dir, LATEST)):
        newest = read_latest(save_dir, required=False) or tags[-1]
        raise CheckpointError(f"--save {save_dir} already holds checkpoints (newest {newest}) but this run starts "
                              f"from scratch and would overwrite them; pass --load {save_dir} to resume, or "
                              "--overwrite-checkpoints to train anew over them")
