"""Which checkpoint a run resumes from, loading it, and the refusal to start from scratch over saved work.

    client = resume_checkpoint(load_dir, state, model, optimizer)   # the decision below, then the loading
    point = find_resume_point(load_dir)   # ResumePoint(directory, checkpoint, universal, note) or None
    refuse_fresh_start_over(save_dir)     # a fresh start while --save holds checkpoints: one sentence

`--load` may name
  - a save directory with `latest`: the checkpoint it names;
  - a save directory without a usable `latest` (none: a crash between the rename and `latest` on a first
    save; or one that holds no directory name, e.g. damaged bytes, or names a directory that is gone)
    but with committed checkpoints: the newest whose every file verifies (said in `note`, which names
    the unusable `latest` and why); without committed checkpoints, that `latest` is refused in one sentence;
  - one checkpoint's own directory (`<save>/global_step6`), ZeRO or universal;
  - a directory with `latest_universal`, or asked for with universal=True: the universal checkpoint.
The chosen directory is opened once (manifest read, sizes checked) and that opened checkpoint is what
the model check (`check`) and the loader read.
A ZeRO checkpoint saved at this TP x PP x DP and ZeRO stage family loads as saved (load.py); saved at
another (an MoE checkpoint's EP included), it is reshaped while loading (universal_load.py), as a universal
checkpoint always is. The layout is the one its manifest records, or, without one read (DeepSpeed's saves,
--no-verify-checkpoint), the one its header and files show (shown_layout.py).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional, Tuple

from .storage.commit import committed_tags, latest_tag, read_latest
from .errors import CheckpointError
from .format import LATEST, MODEL_FILE, ZERO3_MODEL_FILE
from .compat import read_head
from ..model.converters import NO_CONVERTERS, ModelConverters
from .load import CONVERTER_NOTES, load_checkpoint
from .megatron_deepspeed import is_module_layout, writes_qkv_blocks
from .report import layout_here, loaded_line
from .save import saved_layout
from .shown_layout import layout_meta
from .storage.manifest import MANIFEST
from .storage.reader import Checkpoint, open_directory
from .reshape.universal_load import (find_universal_dir, load_reshaped_checkpoint, load_universal_checkpoint,
                                     require_universal_dir)


@dataclass
class ResumePoint:
    directory: str               # the checkpoint directory to read
    checkpoint: Checkpoint       # that directory, opened (manifest read, sizes checked)
    universal: bool = False
    note: Optional[str] = None   # one line for the log, when the choice needs saying


def _is_checkpoint_dir(path: str) -> bool:
    return os.path.isfile(os.path.join(path, MANIFEST)) or any(
        MODEL_FILE.match(f) or ZERO3_MODEL_FILE.match(f) for f in os.listdir(path))


def _newest_verified(load_dir: str, tags, verify: bool, why: str) -> ResumePoint:
    """`why`: what is wrong with `latest` (its absence, or what it holds), the start of the note."""
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
        note = (f"{why}; resuming from its newest {what} checkpoint {tag}"
                + (f", skipping {'; '.join(skipped)}" if skipped else ""))
        return ResumePoint(found.directory, found, note=note)
    raise CheckpointError(f"{why} and none of its checkpoints verifies: {'; '.join(skipped)}")


def _named_by_latest(load_dir: str) -> Tuple[Optional[str], Optional[str]]:
    """(the directory `latest` names, None), or (None, why it names none, as a phrase)."""
    tag, problem = latest_tag(load_dir)
    if tag is None:
        return None, problem
    directory = os.path.join(load_dir, tag)
    if not os.path.isdir(directory):
        return None, f"{os.path.join(load_dir, LATEST)} names {tag}, but the directory {directory} does not exist"
    return directory, None


def find_resume_point(load_dir: str, universal: bool = False, verify: bool = True,
                      step: Optional[int] = None) -> Optional[ResumePoint]:
    """The checkpoint `--load load_dir` means, opened, or None when it holds none (a fresh start); `step`
    (--ckpt-step): the one of that iteration instead of the newest."""
    if not os.path.isdir(load_dir):
        raise CheckpointError(f"--load {load_dir} is not a directory")
    if step is not None:
        return _at_step(load_dir, step, universal, verify)
    has_latest = os.path.isfile(os.path.join(load_dir, LATEST))
    if universal or (not has_latest and find_universal_dir(load_dir) is not None):
        directory = require_universal_dir(load_dir)
        return ResumePoint(directory, open_directory(directory, verify), universal=True)
    why = f"--load {load_dir} has no `{LATEST}` file"
    if has_latest:
        directory, problem = _named_by_latest(load_dir)
        if directory is not None:
            return ResumePoint(directory, open_directory(directory, verify))
        if not committed_tags(load_dir):  # nothing to fall back to
            raise CheckpointError(f"{problem}; it should name a checkpoint directory in {load_dir}, such as "
                                  "global_step100, and no other checkpoint there is complete")
        why = f"{problem}, so it is ignored"  # damaged, or naming what is gone: as if there were none
    if _is_checkpoint_dir(load_dir):
        directory = os.path.normpath(load_dir)
        return ResumePoint(directory, open_directory(directory, verify))
    tags = committed_tags(load_dir)
    return _newest_verified(load_dir, tags, verify, why) if tags else None


def _at_step(load_dir: str, step: int, universal: bool, verify: bool) -> ResumePoint:
    """--ckpt-step: global_step{step} under `load_dir` (its universal conversion with --universal-checkpoint)."""
    tag = f"global_step{step}"
    candidates = [os.path.join(load_dir, tag + "_universal"), os.path.join(load_dir, tag)] if universal else \
        [os.path.join(load_dir, tag)]
    for directory in candidates:
        if os.path.isdir(directory) and (_is_checkpoint_dir(directory) or (universal and find_universal_dir(directory))):
            if universal:
                directory = require_universal_dir(directory)
            newest = read_latest(load_dir, required=False)
            note = f"--ckpt-step {step}: resuming {tag}" + (f", not the newest ({newest})" if newest != tag else "")
            return ResumePoint(directory, open_directory(directory, verify), universal=universal, note=note)
    held = ", ".join(committed_tags(load_dir)) or "none"
    raise CheckpointError(f"--ckpt-step {step}: --load {load_dir} holds no complete {tag} (its checkpoints: {held})")


def resume_checkpoint(path: str, state, model, optimizer, load_optimizer: bool = True, universal: bool = False,
                      verify: bool = True, log=print, check=None, ckpt_format: Optional[str] = None,
                      keep_optimizer=None, step: Optional[int] = None,
                      converters: ModelConverters = NO_CONVERTERS) -> Optional[dict]:
    """Load what `--load path` names (find_resume_point), the one call a run resumes through: a universal
    checkpoint, a checkpoint saved on this layout, or, saved on another TP/PP/DP or ZeRO stage, the same
    reshaped while loading.
    `check(checkpoint)` sees the chosen checkpoint, opened, before anything is loaded from it; after it,
    `keep_optimizer()` False loads the weights only, parameter by parameter (the checkpoint's optimizer is another
    one, its param groups too).
    A Megatron-LM checkpoint (torch_dist or legacy; `ckpt_format`: Megatron-LM's --ckpt-format) loads through
    interop/megatron_load.py. `converters`: the run's model converters (model/converters.py): a load on the saving
    layout restores their state, any other says in a line what of it starts fresh.
    -> the client state, or None when `path` holds no checkpoint."""
    from .interop.megatron_layout import find_megatron_checkpoint
    from .interop.megatron_load import load_megatron_checkpoint  # it reads through reshape/, as universal loads do
    if step is not None and os.path.isdir(path) and find_megatron_checkpoint(path) is not None:
        raise CheckpointError(f"--ckpt-step {step} picks one of our checkpoints; --load {path} is Megatron-LM's: "
                              "pass its iter_XXXXXXX directory as --load instead")
    client = load_megatron_checkpoint(path, state, model, optimizer, load_optimizer, ckpt_format, log, check)
    if client is not None:
        _say_what_starts_fresh(model, converters, log, "a Megatron-LM checkpoint's are not read")
        return client
    point = find_resume_point(path, universal, verify, step)
    if point is None:
        return None
    if point.note:
        log(point.note)
    if check:
        check(point.checkpoint)
    switched = keep_optimizer is not None and not keep_optimizer()  # its param groups are another optimizer's
    load_optimizer = load_optimizer and not switched
    this_layout = layout_here(state, optimizer.stage)
    opened = point.checkpoint
    here = saved_layout(state, model)  # an interleaved pipeline holds other layers: reshaped
    if point.universal:
        _refuse_expert_tp_reshape(point, None, here)
        client = load_universal_checkpoint(point.directory, state, model, optimizer, load_optimizer, verify,
                                           checkpoint=opened)
        log(loaded_line(point.directory, "universal", client, this_layout))
        _say_what_starts_fresh(model, converters, log, "a universal checkpoint keeps none")
        return client
    recorded = layout_meta(opened)  # the manifest's, or what the header and files show where none was read
    saved = recorded["layout"]
    _refuse_expert_tp_reshape(point, saved, here)
    saved_stage = recorded["zero_stage"] if recorded["zero_stage"] is not None else optimizer.stage
    same_stage_family = (saved_stage == 3) == (optimizer.stage == 3)
    if switched or (saved is not None and saved != here) or not same_stage_family or megatron_deepspeed_layout(opened):
        client = load_reshaped_checkpoint(point.directory, state, model, optimizer, load_optimizer, verify,
                                          checkpoint=opened)
        log(loaded_line(point.directory, "plain", client, this_layout))
        _say_what_starts_fresh(model, converters, log, "the checkpoint was saved at another layout")
        return client
    root, tag = os.path.split(point.directory)
    client = load_checkpoint(root, state, model, optimizer, load_optimizer=load_optimizer, tag=tag, verify=verify,
                             checkpoint=opened, converters=converters)
    log(loaded_line(point.directory, "plain", client))
    for line in client.pop(CONVERTER_NOTES, ()):
        log(line)
    return client


def _say_what_starts_fresh(model, converters: ModelConverters, log, why: str) -> None:
    """What a load that cannot restore the saving layout's per-rank state says, one line each: the model converters'
    state (FP8 delayed scaling's amax histories) starts fresh, and so do dropout's random streams (one per TP rank
    and layer chunk: they cannot be mapped to another layout, so a run with dropout drifts from an uninterrupted one, about 1e-4 relative)."""
    for line in converters.starts_fresh(model, why):
        log(line)
    config = getattr(model, "config", None)
    dropout = {k: getattr(config, k, 0.0) for k in ("hidden_dropout", "attention_dropout")}
    if any(dropout.values()):
        given = ", ".join(f"--{k.replace('_', '-')} {v}" for k, v in dropout.items() if v)
        log(f"dropout ({given}): its random streams start fresh, {why}; the losses drift from an uninterrupted "
            "run's by about 1e-4 relative (with dropout 0 a resume here is exact)")


def _refuse_expert_tp_reshape(point, saved: Optional[dict], here: dict) -> None:
    """A run at an expert-tensor-parallel size other than TP loads only a checkpoint saved on its layout (the
    reshaping loader slices experts by TP); a checkpoint saved at one is read at any layout with ETP = TP."""
    if "etp" not in here or (not point.universal and saved == here):
        return
    run = f"TP={here['tp']} x PP={here['pp']} x DP={here['dp']} x EP={here.get('ep', 1)} x ETP={here['etp']}"
    raise CheckpointError(f"the checkpoint {point.directory} was saved on another layout than this run's {run}: "
                          "a run at an expert-tensor-parallel size other than TP resumes only a checkpoint saved on "
                          "its own layout; resume it at --expert-tensor-parallel-size equal to TP")


def megatron_deepspeed_layout(checkpoint, verify: bool = True) -> bool:
    """Was this checkpoint written by or for Megatron-DeepSpeed (its fused QKV order, weights nested under
    `module` -> `language_model`, or no ZeRO optimizer files)? Such a checkpoint is read by name, through the
    reshaping loader (which reorders QKV), at any layout."""
    try:
        head = read_head(checkpoint, verify)  # a directory, or one opened already
    except CheckpointError:
        return False
    if writes_qkv_blocks(head):
        return True
    shapes = head.get("param_shapes")
    if shapes is None:
        return isinstance(head.get("optimizer"), dict)
    return is_module_layout(n for g in shapes for n in g)


def refuse_foreign_load(path: str) -> None:
    """Refuse a --load that holds no checkpoint --load reads but one of a format a converter reads (a torchtitan
    DCP step, a Hugging Face model), naming the format and the command that converts it: a fresh start is only
    for a directory without any checkpoint."""
    from .interop.output_guard import detect_format, name_format
    fmt = detect_format(path) if os.path.isdir(path) else None
    command = {"dcp": f"tools/convert_checkpoint.py --from dcp --to universal --input {path} --output "
                      f"{path.rstrip('/')}_universal --num-attention-heads N --seq-length S, then --load that output "
                      "with --universal-checkpoint",
               "hf": f"tools/convert_from_hf.py --input {path} --output {path.rstrip('/')}_megatron_zero, then --load "
                     "that output"}.get(fmt)
    if command is not None:
        raise CheckpointError(f"--load {path} holds {name_format(path).split(' (')[0]}, which --load does not read; "
                              f"convert it first: {command}")


def refuse_fresh_start_over(save_dir: str) -> None:
    """Refuse a run that starts from scratch while `save_dir` holds checkpoints it would overwrite."""
    if not os.path.isdir(save_dir):
        return
    tags = committed_tags(save_dir)
    if tags or os.path.isfile(os.path.join(save_dir, LATEST)):
        try:
            named = read_latest(save_dir, required=False)
        except CheckpointError:  # an unusable `latest` names nothing to overwrite
            named = None
        newest = named or (tags[-1] if tags else None)
        if newest is None:
            return
        raise CheckpointError(f"--save {save_dir} already holds checkpoints (newest {newest}) but this run starts "
                              f"from scratch and would overwrite them; pass --load {save_dir} to resume, or "
                              "--overwrite-checkpoints to train anew over them")
