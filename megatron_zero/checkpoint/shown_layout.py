"""The layout and ZeRO stage family of a checkpoint: as its manifest records them, or, where none was read (a
checkpoint DeepSpeed or an older build wrote, or any opened with --no-verify-checkpoint), as its files show them.

    meta = layout_meta(checkpoint)   # {"layout": saved_layout's form or None, "zero_stage": 3, a lower stage, or None}

What the files show: TP and PP from the header (format.header_tp_pp), DP x CP from its `dp_world_size` (the
ZeRO files are numbered by it), CP, the virtual stages and the expert sizes from its saved args, and ZeRO-3 by
its per-DP-rank model-states files. A resume compares this with its own layout, as it compares a recorded one, so
a checkpoint without a manifest is reshaped where its layout differs (a weights-only load at another DP size
included: its ZeRO masters then come from the loaded weights) rather than loaded as if it were this run's.
"""
from __future__ import annotations

import os
from typing import Optional

from .compat import read_head
from .errors import CheckpointError
from .format import MODEL_FILE, ZERO3_MODEL_FILE, header_args, header_tp_pp
from .storage.reader import Checkpoint


def _size(args: dict, key: str) -> int:
    value = args.get(key)
    return int(value) if isinstance(value, (int, float)) and value >= 1 else 1


def _shown_layout(checkpoint: Checkpoint) -> Optional[dict]:
    """saved_layout's dict as the header shows it, or None where it does not say TP, PP and DP."""
    try:
        head = read_head(checkpoint)
    except CheckpointError:
        return None
    tp, pp = header_tp_pp(head)
    dp_cp = head.get("dp_world_size")
    if not (tp and pp and isinstance(dp_cp, int) and dp_cp >= 1):
        return None
    args = header_args(head)
    cp, vp = _size(args, "context_parallel_size"), _size(args, "virtual_pipeline_model_parallel_size")
    ep = _size(args, "expert_model_parallel_size")
    etp = _size(args, "expert_tensor_parallel_size") if args.get("expert_tensor_parallel_size") else tp
    return {"tp": tp, "pp": pp, "dp": max(1, dp_cp // cp), **({"vp": vp} if vp > 1 else {}),
            **({"cp": cp} if cp > 1 else {}), **({"ep": ep} if ep > 1 else {}), **({"etp": etp} if etp != tp else {})}


def _shown_stage(directory: str) -> Optional[int]:
    """3 where the model-states files are ZeRO-3's (one per DP rank), 1 for ZeRO 0-2's (one per model-parallel
    rank: the family is what decides), None where there are neither."""
    names = os.listdir(directory)
    if any(ZERO3_MODEL_FILE.match(n) for n in names):
        return 3
    return 1 if any(MODEL_FILE.match(n) for n in names) else None


def layout_meta(checkpoint: Checkpoint) -> dict:
    """{"layout", "zero_stage"}: the manifest's, else what the checkpoint's header and files show (None each where
    they do not say)."""
    meta = checkpoint.meta
    if meta.get("layout") is not None:
        return {"layout": meta["layout"], "zero_stage": meta.get("zero_stage")}
    return {"layout": _shown_layout(checkpoint), "zero_stage": _shown_stage(checkpoint.directory)}
