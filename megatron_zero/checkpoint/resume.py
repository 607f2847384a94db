"""Which checkpoint a run resumes from, loading it, and the refusal to start from scratch over saved work.

    client = resume_checkpoint(load_dir, state, model, optimizer)   # the decision below, then the loading
    point = find_resume_point(load_dir)   # ResumePoint(directory, universal, note) or None (nothing saved)
    refuse_fresh_start_over(save_dir)     # a fresh start while --save holds checkpoints: one sentence

`--load` may name
  - a save directory with `latest`: the checkpoint it names;
  - a save directory without `latest` (a crash between the rename and `latest` on a first save)
    but with committed checkpoints: the newest whose every file verifies (said in `note`);
  - one checkpoint's own directory (`<save>/global_step6`), ZeRO or universal;
  - a directory with `latest_universal`, or asked for with universal=True: the universal checkpoint.
A ZeRO checkpoint saved at this TP x PP x DP and ZeRO stage family loads as saved (load.py); saved at
another, it is reshaped while loading (universal_load.py), as a universal checkpoint always is.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

from .storage.commit import committed_tags, read_latest
from .errors import CheckpointError
from .format import LATEST, LATEST_UNIVERSAL, MODEL_FILE, ZERO3_MODEL_FILE
from .load import load_checkpoint
from .report import loaded_line
from .save import saved_layout
from .storage.manifest import MANIFEST
from .storage.reader import open_directory
from .reshape.universal_load import find_universal_dir, load_reshaped_checkpoint, load_universal_checkpoint


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


def resume_checkpoint(path: str, state, model, optimizer, load_optimizer: bool = True, universal: bool = False,
                      verify: bool = True, log=print, check=None, ckpt_format: Optional[str] = None
                      ) -> Optional[dict]:
    """Load what `--load path` names (find_resume_point), the one call a run resumes through: a universal
    checkpoint, a checkpoint saved on this layout, or, saved on another TP/PP/DP or ZeRO stage, the same
    reshaped while loading.
    `check(directory)` sees the chosen checkpoint directory before anything is loaded from it.
    A Megatron-LM checkpoint (torch_dist or legacy; `ckpt_format`: Megatron-LM's --ckpt-format) loads through
    interop/megatron_load.py.
    -> the client state, or None when `path` holds no checkpoint."""
    from .interop.megatron_load import load_megatron_checkpoint  # it reads through reshape/, as universal loads do
    client = load_megatron_checkpoint(path, state, model, optimizer, load_optimizer, ckpt_format, log, check)
    if client is not None:
        return client
    point = find_resume_point(path, universal, verify)
    if point is None:
        return None
    if point.note:
        log(point.note)
    if check:
        check(point.directory)
    this_layout = f"{state.layout}, ZeRO-{optimizer.stage}"
    if point.universal:
        client = load_universal_checkpoint(point.directory, state, model, optimizer, load_optimizer, verify)
        log(loaded_line(point.directory, "universal", client, this_layout))
        return client
    meta = open_directory(point.directory, verify).meta
    saved = meta.get("layout")
    here = saved_layout(state, model)  # an interleaved pipeline holds other layers: reshaped
    same_stage_family = (meta.get("zero_stage", optimizer.stage) == 3) == (optimizer.stage == 3)
    if saved is not None and (saved != here or not same_stage_family):
        client = load_reshaped_checkpoint(point.directory, state, model, optimizer, load_optimizer, verify)
        log(loaded_line(point.directory, "plain", client, this_layout))
        return client
    root, tag = os.path.split(point.directory)
    client = load_checkpoint(root, state, model, optimizer, load_optimizer=load_optimizer, tag=tag, verify=verify)
    log(loaded_line(point.directory, "plain", client))
    return client


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
