"""The units a model is cut into for per-layer parameter gathers: ``model_units(module)``.

A unit is a direct child of the model, with containers (ModuleList, Sequential, ModuleDict)
expanded recursively, in registration order: for a GPT, the embedding, each transformer layer,
the final norm, the head. ZeRO-3 (stage3.py) gathers a unit's parameters around its forward and
backward; the overlapped parameter all-gather of stages 1/2 (stage12_overlap.py) waits, before a
unit's forward, only for the chunks holding that unit's parameters. Owns nothing else.
"""
from __future__ import annotations

from typing import List

import torch

CONTAINERS = (torch.nn.ModuleList, torch.nn.Sequential, torch.nn.ModuleDict)


def model_units(module: torch.nn.Module) -> List[torch.nn.Module]:
    """The module's children, containers expanded (recursively), in order."""
    out = []
    for child in module.children():
        out.extend(model_units(child) if isinstance(child, CONTAINERS) else [child])
    return out
