"""Scaled upper-triangular masked softmax: the causal attention softmax.

softmax(scale * x) over the last dimension of x [batches, sq, sk], where
key j > query i is masked out (probability 0), computed in fp32 and returned
in x's dtype. The fused kernels (CUDA; fp32 on the CPU) never build the mask and
read only the kept part of each row; the fallback builds the mask.
"""
import torch

from .fusion_flags import use_fused
from .eager import eager_apply
from .registry import extension_for


class _FusedCausalSoftmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scale, ext):
        y = ext.causal_softmax_fwd(x.contiguous(), scale)
        ctx.save_for_backward(y)
        ctx.scale, ctx.ext = scale, ext
        return y

    @staticmethod
    def backward(ctx, dy):
        (y,) = ctx.saved_tensors
        return ctx.ext.causal_softmax_bwd(dy.contiguous(), y, ctx.scale), None, None


def causal_softmax_reference(x, scale):
    sq, sk = x.shape[-2:]  # equal; checked by the caller
    mask = torch.ones(sq, sk, dtype=torch.bool, device=x.device).triu(1)  # key > query
    scores = (x.float() * scale).masked_fill(mask, float("-inf"))
    return torch.softmax(scores, dim=-1).to(x.dtype)


_fused = eager_apply(_FusedCausalSoftmax)  # an extension: left to eager inside a compiled layer


def scaled_upper_triang_masked_softmax(x, scale=1.0, fused=None):
    """Causal softmax of scale*x [batches, sq, sk] along the last dim (sq == sk)."""
    if x.dim() != 3 or x.shape[-1] != x.shape[-2]:
        raise ValueError(f"scaled_upper_triang_masked_softmax expects [batches, sq, sq], "
                         f"got shape {tuple(x.shape)}")
    if use_fused("masked_softmax_fusion", fused) and scale > 0:
        ext = extension_for("scaled_upper_triang_masked_softmax", x)
        if ext is not None:
            return _fused(x, float(scale), ext)
    return causal_softmax_reference(x, scale)
