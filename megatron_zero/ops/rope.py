"""Rotary position embedding (RoPE), non-interleaved (`rotate_half`), as Megatron and Hugging Face Llama.

    cos, sin = rotary_tables(seq_len, rotary_dim, base, device)   # [s, rotary_dim] each, fp32
    q = apply_rotary_pos_emb(q, cos, sin)                          # q: [b, heads, s, head_dim]

The first `rotary_dim` features of each head are rotated, t * cos + rotate_half(t) * sin with
rotate_half([x1, x2]) = [-x2, x1]; the rest pass through (Megatron's --rotary-percent). The
tables are built in fp32 and cast to t's dtype. On CUDA a fused kernel does the rotation in one
pass each way (its backward is the inverse rotation); Megatron's --no-rope-fusion turns it off.
"""
import torch

from .fusion_flags import use_fused
from .eager import eager_apply
from .registry import load, warn_fallback_once

_EXT = "megatron_zero._C_cuda"


def rotary_tables(seq_len: int, rotary_dim: int, base: float, device) -> "tuple[torch.Tensor, torch.Tensor]":
    """cos and sin of position * inv_freq, each [seq_len, rotary_dim] (frequencies repeated twice)."""
    inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64, device=device).float() / rotary_dim))
    positions = torch.arange(seq_len, device=device, dtype=torch.float32)
    freqs = torch.outer(positions, inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def _rotate_half(t: torch.Tensor) -> torch.Tensor:
    x1, x2 = t.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class _FusedRope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, cos, sin):
        ctx.save_for_backward(cos, sin)
        return load(_EXT).rope_apply(t.contiguous(), cos, sin, False)

    @staticmethod
    def backward(ctx, grad):
        cos, sin = ctx.saved_tensors
        return load(_EXT).rope_apply(grad.contiguous(), cos, sin, True), None, None


def _fused_ok(t, cos, sin, fused) -> bool:
    if not (use_fused("rope_fusion", fused) and t.is_cuda and t.dim() >= 2
            and t.dtype in (torch.float32, torch.float16, torch.bfloat16)
            and cos.dtype == sin.dtype == torch.float32 and cos.dim() == 2 and cos.shape == sin.shape
            and cos.shape[0] == t.shape[-2] and cos.shape[1] % 2 == 0 and cos.shape[1] <= t.shape[-1]):
        return False
    if load(_EXT) is None:
        warn_fallback_once("rope", "megatron_zero._C_cuda is not built")
        return False
    return True


_fused = eager_apply(_FusedRope)  # an extension: left to eager inside a compiled layer


def apply_rotary_pos_emb(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, fused=None) -> torch.Tensor:
    """Rotate the first cos.shape[-1] features of t [..., s, head_dim] by position (s is dim -2)."""
    if _fused_ok(t, cos, sin, fused):
        return _fused(t, cos.contiguous(), sin.contiguous())
    rot = cos.shape[-1]
    cos, sin = cos.to(t.dtype), sin.to(t.dtype)
    if rot == t.shape[-1]:
        return t * cos + _rotate_half(t) * sin
    t_rot, t_pass = t[..., :rot], t[..., rot:]
    return torch.cat((t_rot * cos + _rotate_half(t_rot) * sin, t_pass), dim=-1)
