"""GeLU(y + bias) with the tanh approximation (Megatron's bias_gelu).

Fused: one CUDA kernel each way, and only y and bias are kept for backward.
Fallback: F.gelu(y + bias, approximate="tanh"), the same function.
"""
import torch
import torch.nn.functional as F

from .fusion_flags import use_fused
from .registry import load, warn_fallback_once

_EXT = "megatron_zero._C_cuda"


class _FusedBiasGelu(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, bias):
        ctx.save_for_backward(y, bias)
        return load(_EXT).bias_gelu_fwd(y.contiguous(), bias.contiguous())

    @staticmethod
    def backward(ctx, dout):
        y, bias = ctx.saved_tensors
        dy = load(_EXT).bias_gelu_bwd(dout.contiguous(), y.contiguous(), bias.contiguous())
        dbias = dy.reshape(-1, bias.numel()).sum(0, dtype=torch.float32).to(bias.dtype)
        return dy, dbias


def bias_gelu(bias, y, fused=None):
    """GeLU_tanh(y + bias); bias broadcasts over y's last dimension."""
    if (use_fused("bias_gelu_fusion", fused) and y.is_cuda and y.dtype == bias.dtype
            and y.dtype in (torch.float32, torch.float16, torch.bfloat16)
            and bias.dim() == 1 and y.shape[-1] == bias.numel()):
        if load(_EXT) is not None:
            return _FusedBiasGelu.apply(y, bias)
        warn_fallback_once("bias_gelu", "megatron_zero._C_cuda is not built")
    return F.gelu(y + bias, approximate="tanh")
