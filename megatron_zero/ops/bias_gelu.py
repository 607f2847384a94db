"""GeLU(y + bias) with the tanh approximation (Megatron's bias_gelu).

Fused: one kernel each way (CUDA; fp32 on the CPU), and only y and bias are kept for
backward. Fallback: F.gelu(y + bias, approximate="tanh"), the same function.
"""
import torch
import torch.nn.functional as F

from .fusion_flags import use_fused
from .eager import eager_apply
from .registry import extension_for


class _FusedBiasGelu(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, bias, ext):
        ctx.save_for_backward(y, bias)
        ctx.ext = ext
        return ext.bias_gelu_fwd(y.contiguous(), bias.contiguous())

    @staticmethod
    def backward(ctx, dout):
        y, bias = ctx.saved_tensors
        dy = ctx.ext.bias_gelu_bwd(dout.contiguous(), y.contiguous(), bias.contiguous())
        dbias = dy.reshape(-1, bias.numel()).sum(0, dtype=torch.float32).to(bias.dtype)
        return dy, dbias, None


_fused = eager_apply(_FusedBiasGelu)  # an extension: left to eager inside a compiled layer


def bias_gelu(bias, y, fused=None):
    """GeLU_tanh(y + bias); bias broadcasts over y's last dimension."""
    if (use_fused("bias_gelu_fusion", fused) and y.dtype == bias.dtype and bias.dim() == 1
            and y.shape[-1] == bias.numel()):
        ext = extension_for("bias_gelu", y)
        if ext is not None:
            return _fused(y, bias, ext)
    return F.gelu(y + bias, approximate="tanh")
