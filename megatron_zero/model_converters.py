"""The model converters a run's typed configuration asks for, in the one order they apply.

    converters = model_converters(cfg, state, device)    # the run's, from its checked configuration, in order
    lines = converters.convert(model)                      # in place, before the optimizer is made; log lines
    ZeroOptimizer(..., **weight_gathers(converters, model, dp_group, expert_dp_group, device))   # zero/build.py
    converters.post_optimizer_hook(model)                  # after every optimizer step (a skipped one too)
    states.update(converters.state_dict(model, dp_group))  # checkpoint/save.py: the model-states file's entries
    lines = converters.load_state_dict(model, states, optimizer)   # checkpoint/load.py, the same layout
    lines = converters.starts_fresh(model, why)            # a load that cannot restore them (another layout)

The protocol a feature implements and the container are model/converters.py's (which the features, zero/'s
caller zero/build.py and checkpoint/ import); this module alone knows which features there are, and is
training/trainer.py's one call. It sits outside model/, which the configuration's packages import, so that `fp8/` may check
its flags with theirs.
"""
from __future__ import annotations

from typing import List

import torch

from .model.converters import NO_CONVERTERS, ModelConverter, ModelConverters

__all__ = ["ModelConverter", "ModelConverters", "NO_CONVERTERS", "model_converters"]


def model_converters(cfg, state, device: torch.device) -> ModelConverters:
    """The converters a run's checked configuration (config.Config) asks for, in the order they apply: FP8's
    matmuls, the output loss, the compile of each transformer layer (last: it compiles what the others built)."""
    converters: List[ModelConverter] = []
    if cfg.fp8.fp8_format is not None:
        from .fp8.convert import Float8Converter
        from .fp8.settings import Float8Settings

        dp_group = state.dp_group if state.dp_size > 1 else None
        converters.append(Float8Converter(Float8Settings.from_args(cfg.fp8), device,
                                          state.cp_group if state.cp_size > 1 else None, dp_group,
                                          # the ranks holding the same experts: DP x CP without EP
                                          state.expert_dp_group if state.expert_dp_group is not None else dp_group))
    from .model.output_loss_converter import OutputLossConverter

    converters.append(OutputLossConverter(cfg.loss.cross_entropy_loss_fusion))
    if cfg.compile.compile_layers:
        from .compile.layers import CompileLayersConverter

        converters.append(CompileLayersConverter(device, cfg.compile.compile_mode))
    return ModelConverters(converters)
