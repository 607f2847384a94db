"""Rotary position embedding (RoPE), non-interleaved (`rotate_half`), as Megatron and Hugging Face Llama.

    cos, sin = rotary_tables(seq_len, rotary_dim, base, device)   # [s, rotary_dim] each, fp32
    q = apply_rotary_pos_emb(q, cos, sin)                          # q: [b, heads, s, head_dim]

The first `rotary_dim` features of each head are rotated, t * cos + rotate_half(t) * sin with
rotate_half([x1, x2]) = [-x2, x1]; the rest pass through (Megatron's --rotary-percent). The
tables are built in fp32 and cast to t's dtype. There is no compiled kernel for it yet: this
PyTorch code is the one implementation, on every device.
"""
import torch


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


def apply_rotary_pos_emb(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first cos.shape[-1] features of t [..., s, head_dim] by position (s is dim -2)."""
    rot = cos.shape[-1]
    cos, sin = cos.to(t.dtype), sin.to(t.dtype)
    if rot == t.shape[-1]:
        return t * cos + _rotate_half(t) * sin
    t_rot, t_pass = t[..., :rot], t[..., rot:]
    return torch.cat((t_rot * cos + _rotate_half(t_rot) * sin, t_pass), dim=-1)
