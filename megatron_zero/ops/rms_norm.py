"""RMSNorm over the last dimension: weight * x / sqrt(mean(x^2) + eps): the fused CUDA kernel or PyTorch.

Computed in fp32 and cast back to x's dtype before the weight is applied (Megatron's and
Hugging Face Llama's order), in both implementations. The kernels keep 1/rms per row from the
forward pass for the backward pass and sum dweight deterministically. They are used (CUDA; fp32
on the CPU) when the LayerNorm fusion switches allow it (Megatron's --no-persist-layer-norm turns
both norms' kernels off) and x and weight share a dtype. With `zero_centered_gamma` the weight given
is w and the norm applies 1 + w (Megatron-Core's zero_centered_gamma, --apply-layernorm-1p), formed in w's
dtype, in both implementations.
"""
import torch

from .fusion_flags import get_fusion_flags
from .eager import eager_apply
from .registry import extension_for


class _FusedRMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps, ext):
        x2 = x.contiguous().view(-1, x.shape[-1])
        y, invrms = ext.rms_norm_fwd(x2, weight.contiguous(), eps)
        ctx.save_for_backward(x2, weight, invrms)
        ctx.ext = ext
        return y.view_as(x)

    @staticmethod
    def backward(ctx, dy):
        x2, weight, invrms = ctx.saved_tensors
        dx, dweight = ctx.ext.rms_norm_bwd(dy.contiguous().view_as(x2), x2, invrms, weight.contiguous())
        return dx.view(dy.shape), dweight, None, None


def _extension(x, weight, fused):
    flags = get_fusion_flags()
    wanted = fused if fused is not None else flags.layer_norm_fusion and flags.persist_layer_norm
    if not (wanted and x.dtype == weight.dtype and x.shape[-1] == weight.numel()):
        return None
    return extension_for("rms_norm", x)


_fused = eager_apply(_FusedRMSNorm)  # an extension: left to eager inside a compiled layer


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5, fused=None,
             zero_centered_gamma: bool = False) -> torch.Tensor:
    """RMSNorm of x over its last dimension, with an affine weight, or 1 + weight (no bias)."""
    if zero_centered_gamma:
        weight = weight + 1
    ext = _extension(x, weight, fused)
    if ext is not None:
        return _fused(x, weight, eps, ext)
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)
