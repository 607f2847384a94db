"""The residual stream's norms (LayerNorm, RMSNorm; sequence-parallel, zero-centred) and QK-norm's per-head norm,
replicated across TP with their gradients summed where each rank sees other tokens or heads."""
from __future__ import annotations

import torch
from torch import nn

from ..tensor_parallel.layers import sequence_parallel_param, sum_sequence_parallel_grad
from ..tensor_parallel.utils import set_tensor_model_parallel_attributes, tp_world_size
from . import functional
from .config import GPTConfig


def sequence_parallel_active(config: GPTConfig, tp_group) -> bool:
    return config.sequence_parallel and tp_world_size(tp_group) > 1



def _norm_weight(hidden_size: int, dtype, zero_centered: bool) -> nn.Parameter:
    """gamma 1: stored as 1, or zero-centred as 0 (the norm then applies 1 + weight)."""
    fill = torch.zeros if zero_centered else torch.ones
    return set_tensor_model_parallel_attributes(nn.Parameter(fill(hidden_size, dtype=dtype)), False)


class LayerNorm(nn.Module):
    """LayerNorm with `weight` and `bias`, replicated across TP.

    Given `sequence_parallel_group` it normalises a sequence chunk: its parameters are marked
    `sequence_parallel` and their gradients summed over that group in backward. `zero_centered`
    (--apply-layernorm-1p): the weight is w and the norm applies 1 + w.
    """

    def __init__(self, hidden_size: int, eps: float, dtype=torch.float32, sequence_parallel_group=None,
                 zero_centered: bool = False):
        super().__init__()
        self.eps, self.tp_group, self.zero_centered = eps, sequence_parallel_group, zero_centered
        self.weight = _norm_weight(hidden_size, dtype, zero_centered)
        self.bias = set_tensor_model_parallel_attributes(nn.Parameter(torch.zeros(hidden_size, dtype=dtype)), False)
        if sequence_parallel_group is not None:
            sequence_parallel_param(self.weight)
            sequence_parallel_param(self.bias)

    def forward(self, x):
        weight, bias = (sum_sequence_parallel_grad(p, self.tp_group) for p in (self.weight, self.bias))
        return functional.layer_norm(x, weight, bias, self.eps, self.zero_centered)


class RMSNorm(nn.Module):
    """RMSNorm with `weight` only, replicated across TP (sequence-parallel and zero-centred like LayerNorm)."""

    def __init__(self, hidden_size: int, eps: float, dtype=torch.float32, sequence_parallel_group=None,
                 zero_centered: bool = False):
        super().__init__()
        self.eps, self.tp_group, self.zero_centered = eps, sequence_parallel_group, zero_centered
        self.weight = _norm_weight(hidden_size, dtype, zero_centered)
        if sequence_parallel_group is not None:
            sequence_parallel_param(self.weight)

    def forward(self, x):
        weight = sum_sequence_parallel_grad(self.weight, self.tp_group)
        return functional.rms_norm(x, weight, self.eps, self.zero_centered)


def build_norm(config: GPTConfig, tp_group=None) -> nn.Module:
    """The residual stream's norm (LayerNorm or RMSNorm; sequence-parallel when the model is)."""
    norm = RMSNorm if config.normalization == "RMSNorm" else LayerNorm
    sp_group = tp_group if sequence_parallel_active(config, tp_group) else None
    return norm(config.hidden_size, config.layernorm_epsilon, config.params_dtype, sp_group,
                zero_centered=config.apply_layernorm_1p)


def build_head_norm(config: GPTConfig, tp_group=None) -> nn.Module:
    """QK-norm: the model's norm over a head's dimension; each TP rank holds other heads, so the weight's
    gradient is summed over TP (as a sequence-parallel norm's is)."""
    norm = RMSNorm if config.normalization == "RMSNorm" else LayerNorm
    tp = tp_group if tp_world_size(tp_group) > 1 else None
    return norm(config.head_dim, config.layernorm_epsilon, config.params_dtype, tp, zero_centered=config.apply_layernorm_1p)
