"""The log lines a run prints about its checkpoints: which one was loaded, and each save.

    saved_line("ckpt/global_step6", 0.42, 12_582_912)
      -> "saved checkpoint ckpt/global_step6 in 0.42 s (12.6 MB, 30.0 MB/s)"
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


def saved_line(directory: str, seconds: float, nbytes: Optional[int]) -> str:
    if nbytes is None:
        return f"saved checkpoint {directory} in {seconds:.2f} s"
    rate = human_bytes(nbytes / seconds) + "/s" if seconds > 0 else "instantly"
    return f"saved checkpoint {directory} in {seconds:.2f} s ({human_bytes(nbytes)}, {rate})"


def async_started_line(directory: str, seconds: float) -> str:
    return (f"saving checkpoint {directory} asynchronously (started in {seconds:.2f} s; the files are written "
            "while training goes on)")


def saved_layout_text(args) -> Optional[str]:
    """'TP=2 x PP=2 x DP=1, ZeRO-1' from a checkpoint's recorded arguments (dict or Namespace); None if absent."""
    get = args.get if isinstance(args, dict) else (lambda k: getattr(args, k, None))
    tp, pp, dp = (get(k) for k in ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                                   "data_parallel_size"))
    if tp is None or pp is None:
        return None
    text = f"TP={tp} x PP={pp}" + (f" x DP={dp}" if dp is not None else "")
    stage = get("zero_stage")  # Megatron-DeepSpeed records it as a float
    if isinstance(stage, float) and stage.is_integer():
        stage = int(stage)
    return text + (f", ZeRO-{stage}" if stage is not None else "")


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
