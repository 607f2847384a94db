"""Model transforms: converters applied to a built model stage before its optimizer is made.

    model = build_gpt_stage(...)
    report = apply_model_transforms(model, model_converters(sections, state, device))  # a line per converter

A converter is a callable `converter(model) -> str` (a line for the log), changing modules in place and keeping every
parameter object (the optimizer, ZeRO's partitions and hooks, and the checkpoint's names are built from
them next, so a converted model saves and loads as the unconverted one). They apply in the listed order:
FP8 matmuls (megatron_zero/fp8) first; the compile of each transformer layer (megatron_zero/compile,
--compile-layers) last, after the ones that change what a layer computes. This is the one place the
trainer changes a built model.
"""
from __future__ import annotations

from typing import Callable, List

import torch

Converter = Callable[[torch.nn.Module], str]


def model_converters(sections, state, device: torch.device) -> List[Converter]:
    """The converters a run's checked configuration (config.Config) asks for, in the order they apply."""
    converters: List[Converter] = []
    if sections.fp8.fp8_format is not None:
        from .fp8.convert import Float8Converter
        from .fp8.settings import Float8Settings

        dp_group = state.dp_group if state.dp_size > 1 else None
        converters.append(Float8Converter(Float8Settings.from_args(sections.fp8), device,
                                          state.cp_group if state.cp_size > 1 else None, dp_group,
                                          # the ranks holding the same experts: DP x CP without EP
                                          state.expert_dp_group if state.expert_dp_group is not None else dp_group))
    if sections.compile.compile_layers:  # last: it compiles what the converters before it built
        from .compile.layers import CompileLayersConverter

        converters.append(CompileLayersConverter(device, sections.compile.compile_mode))
    return converters


def apply_model_transforms(model: torch.nn.Module, converters: List[Converter]) -> List[str]:
    """Apply each converter in turn, in place; their log lines."""
    return [convert(model) for convert in converters]
