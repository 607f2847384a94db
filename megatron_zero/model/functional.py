"""The model's elementwise kernels, in one place so fused versions can be wired in here alone.

Plain PyTorch for now; megatron_zero/ops/ (fused csrc kernels with PyTorch
fallbacks of identical meaning) can replace these three bodies.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    return F.layer_norm(x, weight.shape, weight, bias, eps)


def scaled_upper_triang_masked_softmax(scores: torch.Tensor, scale: float) -> torch.Tensor:
    """softmax(scale * scores) over the last dim with a causal mask (key j > query i is excluded).

    scores: [..., sq, sk] with sq == sk.
    """
    sq, sk = scores.shape[-2:]
    causal = torch.ones(sq, sk, dtype=torch.bool, device=scores.device).triu_(1)
    probs = torch.softmax((scores.float() * scale).masked_fill(causal, float("-inf")), dim=-1)
    return probs.to(scores.dtype)


def bias_gelu(bias: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """GeLU(x + bias), tanh approximation (Megatron's fused bias_gelu)."""
    return F.gelu(x + bias, approximate="tanh")
