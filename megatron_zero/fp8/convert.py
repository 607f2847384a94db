"""The FP8 model converter: the transformer blocks' linear layers (QKV, projection, MLP) to FP8 matmuls.

A model transform (megatron_zero/model_transforms.py): applied once to the built model stage, before the
optimizer is made. Each ColumnParallelLinear / RowParallelLinear of a block becomes its Float8 subclass in
place (the same module and parameters, as torchao's `convert_to_float8_training` swaps nn.Linear), with a
Float8Matmul that knows the layer's TP split and the groups its scales are reduced over. The word
embedding and the output layer stay in the training dtype (torchao's and Megatron-LM's practice: the
logits' GEMM is the most sensitive to FP8, and the vocabulary projection is one GEMM of many).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from .delayed import AmaxHistory
from .layers import FLOAT8_CLASS, SPLIT
from .matmul import Float8Matmul
from .settings import Float8Settings, require_fp8_device

SKIPPED = ("lm_head",)  # the output layer (its module name); the embedding is not a linear layer


class Float8Converter:
    name = "fp8"

    def __init__(self, settings: Float8Settings, device: torch.device,
                 cp_group: Optional[dist.ProcessGroup] = None, dp_group: Optional[dist.ProcessGroup] = None):
        """`dp_group`: delayed scaling reduces its amaxes over it as well (fp8/delayed.py); None: one replica."""
        require_fp8_device(device, settings.emulate)
        self.settings, self.cp_group, self.dp_group = settings, cp_group, dp_group
        self.config = settings.linear_config()

    def __call__(self, model: torch.nn.Module) -> str:
        """Convert in place; the log line says what."""
        count = 0
        for name, module in model.named_modules():
            cls = type(module)
            if cls in FLOAT8_CLASS and name.rsplit(".", 1)[-1] not in SKIPPED:
                module.__class__ = FLOAT8_CLASS[cls]
                s = self.settings
                history = (AmaxHistory(s.amax_history_len, s.amax_compute_algo, s.margin, module.weight.device)
                           if s.delayed else None)
                module.fp8 = Float8Matmul(self.config, SPLIT[cls], module.tp_group, self.cp_group, s.margin,
                                          history, self.dp_group, s.param_gather)
                count += 1
        s = self.settings
        delayed = f", amax history {s.amax_history_len} ({s.amax_compute_algo})" if s.delayed else ""
        return (f"FP8 ({s.format}, {s.recipe} scaling{delayed}{', emulated' if s.emulate else ''}"
                f"{f', margin {s.margin}' if s.margin else ''}): {count} linear layers of this stage's blocks run "
                "their GEMMs through torchao's float8"
                f"{'; ZeRO all-gathers their weights in FP8' if s.param_gather else ''}")
