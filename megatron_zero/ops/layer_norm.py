"""LayerNorm over the last dimension: the fused CUDA kernel or F.layer_norm.

The kernel keeps the row statistics (mean, 1/std) from the forward pass for the
backward pass, and sums dgamma/dbeta deterministically. With `zero_centered_gamma` the weight
given is w and the norm applies gamma = 1 + w (Megatron's --apply-layernorm-1p), in both
implementations: 1 + w is formed in w's dtype and handed to the kernel as its gamma, so dw = dgamma.
"""
import torch
import torch.nn.functional as F

from .fusion_flags import get_fusion_flags
from .eager import eager_apply
from .registry import load, warn_fallback_once

_EXT = "megatron_zero._C_cuda"


class _FusedLayerNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, eps):
        ext = load(_EXT)
        x2 = x.contiguous().view(-1, x.shape[-1])
        y, mean, invvar = ext.layer_norm_fwd(x2, weight.contiguous(), bias.contiguous(), eps)
        ctx.save_for_backward(x2, weight, mean, invvar)
        return y.view_as(x)

    @staticmethod
    def backward(ctx, dy):
        x2, weight, mean, invvar = ctx.saved_tensors
        ext = load(_EXT)
        dx, dweight, dbias = ext.layer_norm_bwd(dy.contiguous().view_as(x2), x2, mean, invvar,
                                                weight.contiguous())
        return dx.view(dy.shape), dweight, dbias, None


def _built(kernel):
    if load(_EXT) is None:
        warn_fallback_once(kernel, "megatron_zero._C_cuda is not built")
        return False
    return True


def _fused_ok(x, weight, bias, fused):
    wanted = fused if fused is not None else (
        get_fusion_flags().layer_norm_fusion and get_fusion_flags().persist_layer_norm)
    return (wanted and x.is_cuda and weight is not None and bias is not None
            and x.dtype == weight.dtype == bias.dtype
            and x.dtype in (torch.float32, torch.float16, torch.bfloat16)
            and _built("layer_norm"))


_fused = eager_apply(_FusedLayerNorm)  # an extension: left to eager inside a compiled layer


def layer_norm(x, weight, bias, eps=1e-5, fused=None, zero_centered_gamma=False):
    """LayerNorm of x over its last dimension, with affine weight (or 1 + weight) and bias."""
    if zero_centered_gamma:
        weight = weight + 1
    if _fused_ok(x, weight, bias, fused):
        return _fused(x, weight, bias, eps)
    return F.layer_norm(x, x.shape[-1:], weight, bias, eps)

