"""The FP8 model converter: the transformer blocks' linear layers (QKV, projection, MLP) to FP8 matmuls.

A model converter (megatron_zero/model/converters.py): applied once to the built model stage, before the
optimizer is made. Each ColumnParallelLinear / RowParallelLinear of a block becomes its Float8 subclass in
place (the same module and parameters, as torchao's `convert_to_float8_training` swaps nn.Linear), with a
Float8Matmul that knows the layer's TP split and the groups its scales are reduced over; an MoE expert's
layers reduce their tokens' amaxes over the expert-data-parallel group instead of CP and DP (experts.py).
The router stays in the training dtype (its weight is no linear layer), as in Megatron-LM. The word
embedding and the output layer stay in the training dtype (torchao's and Megatron-LM's practice: the
logits' GEMM is the most sensitive to FP8, and the vocabulary projection is one GEMM of many).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from ..model.converters import ModelConverter
from .delayed import (STATE_KEY, AmaxHistory, AmaxReductions, checkpoint_scaling_state, fresh_line, histories,
                      load_scaling_state)
from .experts import expert_config, is_expert
from .layers import FLOAT8_CLASS, SPLIT
from .matmul import Float8Matmul
from .param_gather import Float8ParamGather, gathered_layers
from .settings import Float8Settings, require_fp8_device

SKIPPED = ("lm_head",)  # the output layer (its module name); the embedding is not a linear layer


class Float8Converter(ModelConverter):
    name = "fp8"
    state_key = STATE_KEY  # delayed scaling's amax histories and scales (delayed.py)

    def __init__(self, settings: Float8Settings, device: torch.device,
                 cp_group: Optional[dist.ProcessGroup] = None, dp_group: Optional[dist.ProcessGroup] = None,
                 expert_dp_group: Optional[dist.ProcessGroup] = None, device_check: bool = True):
        """`dp_group`: delayed scaling reduces its amaxes over it as well (fp8/delayed.py); None: one replica.
        `expert_dp_group`: the ranks holding the same experts (the DP x CP group without expert parallelism).
        `device_check` False: no refusal of a device without FP8 tensor cores (the planner's fake build,
        planning/fake_rank.py, plans on the CPU for the run's GPU)."""
        if device_check:
            require_fp8_device(device, settings.emulate)
        self.settings, self.cp_group, self.dp_group = settings, cp_group, dp_group
        self.expert_dp_group = expert_dp_group
        self.config = settings.linear_config()

    def convert(self, model: torch.nn.Module) -> str:
        """Convert in place; the log line says what."""
        count = experts = 0
        reductions = AmaxReductions()  # delayed scaling: the model's layers' amaxes reduced together (delayed.py)
        for name, module in model.named_modules():
            cls = type(module)
            if cls in FLOAT8_CLASS and name.rsplit(".", 1)[-1] not in SKIPPED:
                module.__class__ = FLOAT8_CLASS[cls]
                s = self.settings
                history = (AmaxHistory(s.amax_history_len, s.amax_compute_algo, s.margin, module.weight.device,
                                       reductions) if s.delayed else None)
                if is_expert(module):  # its tokens split over expert-DP only (experts.py)
                    module.fp8 = Float8Matmul(expert_config(self.config), SPLIT[cls], module.tp_group,
                                              self.expert_dp_group, s.margin, history, param_gather=s.param_gather)
                    experts += 1
                else:
                    module.fp8 = Float8Matmul(self.config, SPLIT[cls], module.tp_group, _token_group(module,
                                              self.cp_group), s.margin, history, self.dp_group, s.param_gather)
                count += 1
        s = self.settings
        delayed = f", amax history {s.amax_history_len} ({s.amax_compute_algo})" if s.delayed else ""
        return (f"FP8 ({s.format}, {s.recipe} scaling{delayed}{', emulated' if s.emulate else ''}"
                f"{f', margin {s.margin}' if s.margin else ''}): {count} linear layers of this stage's blocks"
                f"{f' ({experts} of them the MoE experts, each scaled on its own rows)' if experts else ''} run "
                "their GEMMs through torchao's float8"
                f"{'; ZeRO all-gathers their weights in FP8' if s.param_gather else ''}")

    def weight_gather(self, model: torch.nn.Module, dp_group, device: torch.device, experts: Optional[bool] = None):
        """--fp8-param-gather: the FP8 side of ZeRO's weight gather (param_gather.py), or None."""
        return fp8_weight_gather(model, dp_group, device, experts) if self.settings.param_gather else None

    def state_dict(self, model: torch.nn.Module, dp_group) -> Optional[dict]:
        """Delayed scaling's amax histories and scales, every DP rank's MoE experts' with them (collective)."""
        return checkpoint_scaling_state(model, dp_group)

    def load_state_dict(self, model: torch.nn.Module, saved: Optional[dict], optimizer) -> Optional[str]:
        """The histories restored (bit-exact: the same layout), then --fp8-param-gather's FP8 weights cast
        again from the restored masters with the restored scales."""
        note = load_scaling_state(model, saved)
        optimizer.refresh_fp8_weights()
        return note

    def starts_fresh(self, model: torch.nn.Module, why: str) -> Optional[str]:
        return fresh_line(why) if next(histories(model), None) is not None else None


def fp8_weight_gather(model: torch.nn.Module, dp_group, device: torch.device, experts: Optional[bool] = None):
    """The FP8 side of ZeRO's weight gather over `dp_group` for the model's layers converted with
    --fp8-param-gather (`experts` True / False: the MoE experts' only, over expert-DP / the others only; None:
    all), or None where it has none."""
    layers = gathered_layers(model, experts)
    return Float8ParamGather(layers, dp_group, device) if layers else None


def _token_group(module, cp_group):
    """The group splitting a layer's tokens: CP's, or for a replicated layer on a sequence-parallel chunk (MLA's
    down-projections) the sequence-parallel group (with CP as well, CP's alone: the amaxes then differ over TP)."""
    sp_group = getattr(module, "sequence_parallel_group", None)
    return cp_group if cp_group is not None or sp_group is None else sp_group

