"""Model transforms: converters applied to a built model stage before its optimizer is made.

    model = build_gpt_stage(...)
    report = apply_model_transforms(model, model_converters(args, state, device))  # a line per converter

A converter is a callable `converter(model) -> str` (a line for the log), changing modules in place and keeping every
parameter object (the optimizer, ZeRO's partitions and hooks, and the checkpoint's names are built from
them next, so a converted model saves and loads as the unconverted one). They apply in the listed order:
FP8 matmuls (megatron_zero/fp8) first; a converter that compiles each block comes after the ones that
change what a block computes. This is the one place the trainer changes a built model.
"""
from __future__ import annotations

from typing import Callable, List

import torch

Converter = Callable[[torch.nn.Module], str]


def model_converters(args, state, device: torch.device) -> List[Converter]:
    """The converters a run's flags ask for, in the order they apply."""
    converters: List[Converter] = []
    if getattr(args, "fp8_format", None):
        from .fp8.convert import Float8Converter
        from .fp8.settings import Float8Settings

        converters.append(Float8Converter(Float8Settings.from_args(args), device,
                                          state.cp_group if state.cp_size > 1 else None,
                                          state.dp_group if state.dp_size > 1 else None))
    return converters


def apply_model_transforms(model: torch.nn.Module, converters: List[Converter]) -> List[str]:
    """Apply each converter in turn, in place; their log lines."""
    return [convert(model) for convert in converters]
