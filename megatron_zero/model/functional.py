"""The model's elementwise kernels, in one place: each goes through megatron_zero.ops, which runs
the fused csrc/ kernel where it is built and allowed (Megatron's --no-*-fusion flags turn them off)
and otherwise the PyTorch fallback of identical meaning.
"""
from __future__ import annotations

import torch

from .. import ops


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float,
               zero_centered_gamma: bool = False) -> torch.Tensor:
    return ops.layer_norm(x, weight, bias, eps, zero_centered_gamma=zero_centered_gamma)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered_gamma: bool = False) -> torch.Tensor:
    return ops.rms_norm(x, weight, eps, zero_centered_gamma=zero_centered_gamma)


def apply_rotary_pos_emb(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return ops.apply_rotary_pos_emb(t, cos, sin)


def swiglu(x: torch.Tensor) -> torch.Tensor:
    return ops.swiglu(x)


def scaled_upper_triang_masked_softmax(scores: torch.Tensor, scale: float, fused=None) -> torch.Tensor:
    """softmax(scale * scores) over the last dim with a causal mask (key j > query i is excluded).

    scores: [..., sq, sk] with sq == sk. `fused`: None follows the fusion switch, True/False override it.
    """
    sq, sk = scores.shape[-2:]
    probs = ops.scaled_upper_triang_masked_softmax(scores.reshape(-1, sq, sk), scale, fused=fused)
    return probs.view(scores.shape)


def bias_gelu(bias: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """GeLU(x + bias), tanh approximation (Megatron's fused bias_gelu)."""
    return ops.bias_gelu(bias, x)
