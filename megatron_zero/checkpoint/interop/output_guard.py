"""What a converter's output directory already holds, and the writes that would move a checkpoint pointer backwards.

    detect_format(path)                            # 'deepspeed' | 'universal' | 'torch_dist' | ... | None
    check_output("torch_dist", out, 4, force)      # one sentence naming --force, or nothing

Each sink and the pointer it writes (the file a loader follows to the newest checkpoint):

    torch_dist   <out>/latest_checkpointed_iteration.txt -> iter_N     (Megatron-LM's --load)
    dcp          none: torchtitan resumes the largest <out>/step-N
    universal    <parent of out>/latest_universal -> out             (--universal-checkpoint, zero_to_fp32.py)

Refused unless forced: an output whose pointer (or largest step) names a newer iteration than the one written
(a resume would silently go back, or ignore the conversion), and, for torch_dist and dcp, an output that is a
megatron_zero (DeepSpeed-layout) save directory: its `latest` and the written pointer would disagree. A universal
checkpoint beside a save directory's global_stepN is the documented place (tools/ds_to_universal.py), so that is
allowed. No converter writes the DeepSpeed / Megatron-DeepSpeed layouts (`latest`): pretrain_gpt.py's saves do.
"""
from __future__ import annotations

import json
import os
import re
from typing import Optional

from ..errors import CheckpointError
from ..format import LATEST, LATEST_ITERATION, LATEST_UNIVERSAL
from .megatron_layout import LEGACY, find_megatron_checkpoint

FORCE = "--force"
ITER_DIR = re.compile(r"^iter_(\d{7})$")
STEP_DIR = re.compile(r"^step-(\d+)$")


def is_save_dir(path: str) -> bool:
    """A megatron_zero / DeepSpeed save directory: `latest` naming a checkpoint tag beside it."""
    return os.path.isfile(os.path.join(path, LATEST))


def _is_zero_checkpoint(path: str) -> bool:
    names = os.listdir(path)
    return any(n.endswith("_model_states.pt") or n.endswith("_optim_states.pt") for n in names)


def detect_format(path: str) -> Optional[str]:
    """The checkpoint format `path` holds (a save directory or one checkpoint in it), in --from's names."""
    from ..reshape.universal_load import find_universal_dir
    if not os.path.isdir(path):
        return None
    if os.path.isfile(os.path.join(path, "zero", "optimizer_state.pt")) or (
            os.path.isfile(os.path.join(path, LATEST_UNIVERSAL)) and not is_save_dir(path)):
        return "universal"
    if is_save_dir(path) or _is_zero_checkpoint(path):
        return "deepspeed"
    try:
        found = find_megatron_checkpoint(path)
    except CheckpointError:
        found = None
    if found is not None:
        return "megatron_legacy" if found[1] == LEGACY else "torch_dist"
    names = os.listdir(path)
    if ".metadata" in names:
        return "dcp"
    if any(n.endswith(".safetensors") or n == "pytorch_model.bin" or n.endswith(".index.json") for n in names) \
            and "config.json" in names:
        return "hf"
    if find_universal_dir(path):
        return "universal"
    return None


def _newest_megatron_iteration(out: str) -> Optional[int]:
    its = [int(m.group(1)) for m in map(ITER_DIR.match, os.listdir(out)) if m]
    tracker = os.path.join(out, LATEST_ITERATION)
    if os.path.isfile(tracker):
        with open(tracker) as f:
            text = f.read().strip()
        if text.isdigit():
            its.append(int(text))
    return max(its) if its else None


def _universal_iteration(directory: str) -> Optional[int]:
    try:
        with open(os.path.join(directory, "manifest.json")) as f:
            return int(json.load(f).get("iteration"))
    except (OSError, ValueError, TypeError):
        return None


def check_output(fmt: str, out: str, iteration: int, force: bool = False, flag: str = FORCE) -> None:
    """Refuse, in one sentence naming `flag`, writing iteration `iteration` as `fmt` at `out` where that would
    move a pointer backwards or mix layouts (see the module's doc)."""
    if force:
        return
    if fmt == "universal":
        parent = os.path.dirname(os.path.normpath(out)) or "."
        latest = os.path.join(parent, LATEST_UNIVERSAL)
        if not os.path.isfile(latest):
            return
        try:
            with open(latest, "rb") as f:
                named = f.read(4096).decode("utf-8").strip()
        except UnicodeDecodeError:  # a damaged pointer names nothing to protect; the loaders say so themselves
            return
        newer = _universal_iteration(os.path.join(parent, named))
        if newer is not None and newer > iteration:
            raise CheckpointError(f"{latest} names {named}, a universal checkpoint at iteration {newer}, and writing "
                                  f"iteration {iteration} as {out} would point it back to the older one; choose "
                                  f"another directory or pass {flag} to move it back")
        return
    if not os.path.isdir(out):
        return
    if is_save_dir(out):
        raise CheckpointError(f"{out} is a megatron_zero save directory (it has `{LATEST}`), and a {fmt} checkpoint "
                              f"written into it would leave two checkpoint pointers that disagree; choose another "
                              f"--output or pass {flag}")
    if fmt == "torch_dist":
        newer = _newest_megatron_iteration(out)
        what = f"{os.path.join(out, LATEST_ITERATION)} / its iter_* directories"
    else:
        steps = [int(m.group(1)) for m in map(STEP_DIR.match, os.listdir(out)) if m]
        newer, what = (max(steps) if steps else None), f"{out}/step-*"
    if newer is not None and newer > iteration:
        raise CheckpointError(f"{out} holds iteration {newer} ({what}), newer than the iteration {iteration} being "
                              f"written, so a resume from it would {'go back to' if fmt == 'torch_dist' else 'ignore'} "
                              f"the converted one; choose another --output or pass {flag}")


def name_format(path: str) -> str:
    """How detect_format's answer reads in a sentence."""
    fmt = detect_format(path)
    if fmt is None:
        return "empty" if os.path.isdir(path) and not os.listdir(path) else "not a checkpoint this tool recognizes"
    return {"deepspeed": "a megatron_zero / DeepSpeed ZeRO checkpoint (--from deepspeed)",
            "universal": "a universal checkpoint (--from universal)",
            "torch_dist": "a Megatron-LM torch_dist checkpoint (--from torch_dist)",
            "megatron_legacy": "a Megatron-LM legacy checkpoint (--from megatron_legacy)",
            "dcp": "a torch.distributed.checkpoint (torchtitan) directory (--from dcp)",
            "hf": "a Hugging Face model (tools/convert_from_hf.py)"}[fmt]

