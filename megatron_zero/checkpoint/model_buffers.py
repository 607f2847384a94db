"""The model's persistent buffers in a checkpoint: state that is not a parameter (the routers' expert bias,
moe/expert_bias.py), so neither the optimizer files nor a universal checkpoint's zero/ folder hold it.

    saved     in every model-states file's `module` (deepspeed_layout.engine_state; DeepSpeed's place for
              buffers, which its zero_to_fp32 adds to the weights) and, at ZeRO 0-2, beside the weights in
              the layer files; the names are the model's (global layer indices) and each buffer is whole
              (not split over TP, EP or ZeRO), so a name means the same tensor at every layout
    loaded    as saved at ZeRO 0-2: with the layer files' weights (load.py); as saved at ZeRO-3: from this
              rank's model-states file; reshaped or universal: from the model-states files of the saved
              pipeline stages, TP rank 0's of each (a universal checkpoint keeps copies of them), the bytes
              as saved. A buffer the checkpoint lacks (saved before the model had it) keeps its initial value;
              one of this rank's layers that the model lacks (--moe-router-enable-expert-bias dropped) is refused.
"""
from __future__ import annotations

from typing import Callable, Dict, Optional

import torch

from .deepspeed_layout import layer_of, persistent_buffers
from .errors import CheckpointError
from .format import header_tp_pp


def restore_buffers(model, saved: Optional[Dict[str, torch.Tensor]], where: str) -> None:
    """Copy each of `model`'s persistent buffers that `saved` holds (by name) into it, shapes checked."""
    saved = saved or {}
    mine = persistent_buffers(model)
    layers = set(model.layer_indices)
    refuse_unknown([n for n in saved if n not in mine and n[:1].isdigit() and layer_of(n)[0] in layers], where)
    for name, buf in mine.items():
        if name not in saved:
            continue
        value = saved[name]
        if tuple(value.shape) != tuple(buf.shape):
            raise CheckpointError(f"{where} holds {name} of shape {list(value.shape)}, this model {list(buf.shape)}; "
                                  "build the model with the checkpoint's arguments")
        with torch.no_grad():
            buf.copy_(value)


def refuse_unknown(names, where: str) -> None:
    """One sentence for saved buffers this model has no place for."""
    if names:
        raise CheckpointError(f"{where} holds {names[0]}{f' and {len(names) - 1} more' if len(names) > 1 else ''}, "
                              "state this model does not have (the routers' expert bias: "
                              "--moe-router-enable-expert-bias); build the model with the checkpoint's arguments")


def saved_buffers(model_states: Callable[[int], Optional[dict]]) -> dict:
    """name -> tensor of every persistent buffer the saved stages' model-states files hold (`model_states(mp)`:
    the file of model-parallel rank mp = pp_rank x TP + tp_rank, or None; TP and PP as the first one records)."""
    tp, pp = header_tp_pp(model_states(0) or {})
    out: dict = {}
    for stage in range(pp or 1):
        states = model_states(stage * (tp or 1)) or {}
        module = states.get("module")
        names = set(states.get("buffer_names") or ())
        if isinstance(module, dict):
            out.update((n, t) for n, t in module.items() if n in names and isinstance(t, torch.Tensor))
    return out
