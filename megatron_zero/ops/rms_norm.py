"""RMSNorm over the last dimension: weight * x / sqrt(mean(x^2) + eps): the fused CUDA kernel or PyTorch.

Computed in fp32 and cast back to x's dtype before the weight is applied (Megatron's and
Hugging Face Llama's order), in both implementations. The kernel keeps 1/rms per row from the
forward pass for the backward pass and sums dweight deterministically. It is used on CUDA when
the LayerNorm fusion switches allow it (Megatron's --no-persist-layer-norm turns both norms'
kernels off) and x and weight share a dtype.
"""
import torch

from .fusion_flags import get_fusion_flags
from .registry import load, warn_fallback_once

_EXT = "megatron_zero._C_cuda"


class _FusedRMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        x2 = x.contiguous().view(-1, x.shape[-1])
        y, invrms = load(_EXT).rms_norm_fwd(x2, weight.contiguous(), eps)
        ctx.save_for_backward(x2, weight, invrms)
        return y.view_as(x)

    @staticmethod
    def backward(ctx, dy):
        x2, weight, invrms = ctx.saved_tensors
        dx, dweight = load(_EXT).rms_norm_bwd(dy.contiguous().view_as(x2), x2, invrms, weight.contiguous())
        return dx.view(dy.shape), dweight, None


def _fused_ok(x, weight, fused) -> bool:
    flags = get_fusion_flags()
    wanted = fused if fused is not None else flags.layer_norm_fusion and flags.persist_layer_norm
    if not (wanted and x.is_cuda and x.dtype == weight.dtype
            and x.dtype in (torch.float32, torch.float16, torch.bfloat16)):
        return False
    if load(_EXT) is None:
        warn_fallback_once("rms_norm", "megatron_zero._C_cuda is not built")
        return False
    return True


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5, fused=None) -> torch.Tensor:
    """RMSNorm of x over its last dimension, with an affine weight (no bias)."""
    if _fused_ok(x, weight, fused):
        return _FusedRMSNorm.apply(x, weight, eps)
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)
