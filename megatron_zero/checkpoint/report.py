"""The log lines a run prints about its checkpoints: which one was loaded, and each save.

    saved_line("ckpt/global_step6", 0.42, 12_582_912)
      -> "saved checkpoint ckpt/global_step6 in 0.42 s (12.6 MB, 30.0 MB/s)"
    saved_line("ckpt/weights_only/global_step5", 0.2, 4_194_304, weights_only=True)
      -> "saved weights-only checkpoint ckpt/weights_only/global_step5 in 0.20 s (4.2 MB, 21.0 MB/s; no optimizer
          state: a --load of it starts a fresh optimizer at iteration 0)"
    loaded_line("ckpt/global_step6", "plain", client, here="TP=1 x PP=1 x DP=4, ZeRO-2")
      -> "loaded checkpoint global_step6 (plain, iteration 6, saved at TP=2 x PP=2 x DP=1, ZeRO-1) from
          ckpt/global_step6, reshaped to TP=1 x PP=1 x DP=4, ZeRO-2"

Kinds: "plain" (our / DeepSpeed's ZeRO layout), "universal" (tools/ds_to_universal.py), and a
Hugging Face import (tools/convert_from_hf.py: weights only, a fresh optimizer at iteration 0). The
layout a checkpoint was saved at is read from the arguments it records (Megatron-DeepSpeed's names).
"""
from __future__ import annotations

import os
from typing import Optional

from .storage.manifest import read_manifest


def human_bytes(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


def checkpoint_size(directory: str) -> Optional[int]:
    """The bytes of a committed checkpoint's files, from its manifest (None: it has none)."""
    manifest = read_manifest(directory)
    return None if manifest is None else sum(int(f["size"]) for f in manifest["files"].values())


WEIGHTS_ONLY = "weights-only checkpoint"  # --no-save-optim, --save-weights-interval: no optimizer state
WEIGHTS_ONLY_NOTE = "no optimizer state: a --load of it starts a fresh optimizer at iteration 0"


def saved_line(directory: str, seconds: float, nbytes: Optional[int], weights_only: bool = False) -> str:
    what = WEIGHTS_ONLY if weights_only else "checkpoint"
    note = [WEIGHTS_ONLY_NOTE] if weights_only else []
    if nbytes is not None:
        note.insert(0, f"{human_bytes(nbytes)}, " + (human_bytes(nbytes / seconds) + "/s" if seconds > 0 else
                                                       "instantly"))
    return f"saved {what} {directory} in {seconds:.2f} s" + (f" ({'; '.join(note)})" if note else "")


def async_started_line(directory: str, seconds: float, weights_only: bool = False) -> str:
    what = WEIGHTS_ONLY if weights_only else "checkpoint"
    return (f"saving {what} {directory} asynchronously (started in {seconds:.2f} s; the files are written "
            "while training goes on" + (f"; {WEIGHTS_ONLY_NOTE})" if weights_only else ")"))


def _more_than_one(value) -> Optional[int]:
    """A recorded parallel size worth naming: above 1 (Megatron-DeepSpeed may record a list or a float)."""
    if isinstance(value, (list, tuple)):
        value = max(value) if value else None
    try:
        return int(value) if value is not None and int(value) > 1 else None
    except (TypeError, ValueError):
        return None


def saved_layout_text(args) -> Optional[str]:
    """'TP=2 x PP=2 x DP=1, ZeRO-1' from a checkpoint's recorded arguments (dict or Namespace), with ' x CP=c' and
    ' x EP=e' where those were above 1 ('TP=1 x PP=1 x DP=1 x CP=2 x EP=2, ZeRO-1'); None if absent."""
    get = (args if isinstance(args, dict) else vars(args)).get
    tp, pp, dp = (get(k) for k in ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                                   "data_parallel_size"))
    if tp is None or pp is None:
        return None
    text = f"TP={tp} x PP={pp}" + (f" x DP={dp}" if dp is not None else "")
    for name, key in (("CP", "context_parallel_size"), ("EP", "expert_model_parallel_size")):
        size = _more_than_one(get(key))
        text += f" x {name}={size}" if size else ""
    stage = get("zero_stage")  # Megatron-DeepSpeed records it as a float
    if isinstance(stage, float) and stage.is_integer():
        stage = int(stage)
    return text + (f", ZeRO-{stage}" if stage is not None else "")


def layout_here(state, zero_stage) -> str:
    """This run's layout as saved_layout_text writes a checkpoint's: 'TP=1 x PP=1 x DP=2 x EP=2, ZeRO-1'."""
    ep = getattr(state, "ep_size", 1)
    return f"{state.layout}" + (f" x EP={ep}" if ep > 1 else "") + f", ZeRO-{zero_stage}"


def loaded_line(directory: str, kind: str, client: dict, here: Optional[str] = None) -> str:
    """One line: the tag, the kind, the iteration and the layout it was saved at; `here`: the layout it was
    reshaped to (None: loaded as saved)."""
    directory = os.path.normpath(directory)
    tag = os.path.basename(directory)
    if client.get("hf_architecture"):
        return (f"loaded the Hugging Face import {tag} ({client['hf_architecture']}, weights only: a fresh "
                f"optimizer at iteration 0) from {directory}")
    args = client.get("args") or {}
    saved = saved_layout_text(args)
    what = [kind, f"iteration {client.get('iteration', 0)}"]
    what.append(f"saved at {saved}" if saved else "layout not recorded")
    line = f"loaded checkpoint {tag} ({', '.join(what)}) from {directory}"
    return line + (f", reshaped to {here}" if here else "")
