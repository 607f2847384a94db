"""RMSNorm over the last dimension: weight * x / sqrt(mean(x^2) + eps).

Computed in fp32 and cast back to x's dtype before the weight is applied (Megatron's and
Hugging Face Llama's order). There is no compiled kernel for it yet: this PyTorch code is the
one implementation, on every device.
"""
import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """RMSNorm of x over its last dimension, with an affine weight (no bias)."""
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)
