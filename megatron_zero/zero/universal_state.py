"""Set a ZeroOptimizer's fp32 masters and Adam moments from per-parameter tensors (any stage, any DP).

    set_state_from_params(opt, local, step)

`local(name)` returns {'fp32', 'exp_avg', 'exp_avg_sq'}: this rank's TP-form tensors of the
parameter (the shape the model holds). Each is flattened and narrowed to the elements this
rank's ZeRO partition owns (``impl.owned_ranges``: stage 1/2 flat partitions, stage 3
per-parameter chunks); padding stays zero. The model weights are then published from the
masters (``impl.write_weights``: an all-gather over DP at stage 1/2), so every DP rank calls it.
"""
from __future__ import annotations

from typing import Callable, Dict

import torch

KEYS = ("fp32", "exp_avg", "exp_avg_sq")


def set_state_from_params(opt, local: Callable[[str], Dict[str, torch.Tensor]], step: int) -> None:
    with opt.optimizer.paged() as masters:
        for gi, group in enumerate(opt.named_groups):
            name_of = {id(p): n for n, p in group}
            size = masters[gi].numel()
            bufs = {k: torch.zeros(size, dtype=torch.float32, device=masters[gi].device) for k in KEYS}  # where
            # the state lives: each parameter's fragment is copied there as it is read, none held on the host
            for p, in_param, in_part, numel in opt.impl.owned_ranges(gi):
                tensors = local(name_of[id(p)])
                for k in KEYS:
                    flat = tensors[k].reshape(-1)
                    expected = getattr(p, "ds_numel", None) or p.numel()
                    if flat.numel() != expected:
                        raise ValueError(f"{name_of[id(p)]} ({k}) has {flat.numel()} elements in the checkpoint "
                                         f"but this rank's parameter has {expected}")
                    bufs[k].narrow(0, in_part, numel).copy_(flat.narrow(0, in_param, numel))
            state = {"step": torch.tensor(float(step)), "exp_avg": bufs["exp_avg"], "exp_avg_sq": bufs["exp_avg_sq"]}
            opt.optimizer.set_state(gi, state, bufs["fp32"])
        opt.impl.write_weights(masters)
