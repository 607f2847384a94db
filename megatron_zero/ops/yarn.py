"""YaRN RoPE tables (DeepSeek-V3's long-context scaling), as Megatron-Core's YarnRotaryEmbedding.

    cos, sin = yarn_rotary_tables(seq_len, rotary_dim, base, scaling_factor=40.0,
                                  original_max_position_embeddings=4096)   # [s, rotary_dim], fp32

The inverse frequencies blend the original ones (high-frequency dimensions, more than
`beta_fast` rotations over the original context) with ones interpolated by `scaling_factor`
(fewer than `beta_slow` rotations), linearly in between; cos and sin are multiplied by the
concentration factor mscale(scaling_factor, mscale) / mscale(scaling_factor, mscale_all_dim),
mscale(s, m) = 0.1 * m * ln(s) + 1 for s > 1. The tables feed apply_rotary_pos_emb (ops/rope.py).
"""
import math

import torch


def _correction_dim(rotations: float, dim: int, base: float, original_max_position_embeddings: int) -> float:
    """The rotary dimension whose frequency turns `rotations` times over the original context."""
    return dim * math.log(original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(base))


def yarn_mscale(scaling_factor: float, mscale: float = 1.0) -> float:
    """0.1 * mscale * ln(scaling_factor) + 1, or 1 when the context is not extended."""
    return 1.0 if scaling_factor <= 1 else 0.1 * mscale * math.log(scaling_factor) + 1.0


def concentration_factor(scaling_factor: float, mscale: float = 1.0, mscale_all_dim: float = 0.0) -> float:
    """The factor on cos and sin (and, through them, on the attention logits)."""
    return yarn_mscale(scaling_factor, mscale) / yarn_mscale(scaling_factor, mscale_all_dim)


def yarn_inv_freq(rotary_dim: int, base: float, scaling_factor: float, original_max_position_embeddings: int,
                  beta_fast: float = 32.0, beta_slow: float = 1.0, device=None) -> torch.Tensor:
    """[rotary_dim / 2] fp32 inverse frequencies, original and interpolated blended by the ramp."""
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.float32, device=device) / rotary_dim
    extrapolated = 1.0 / (base ** exponents)
    interpolated = 1.0 / (scaling_factor * base ** exponents)
    low = max(math.floor(_correction_dim(beta_fast, rotary_dim, base, original_max_position_embeddings)), 0)
    high = min(math.ceil(_correction_dim(beta_slow, rotary_dim, base, original_max_position_embeddings)),
               rotary_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float32, device=device) - low) / (high - low)).clamp(0, 1)
    keep = 1.0 - ramp
    return interpolated * (1 - keep) + extrapolated * keep


def yarn_rotary_tables(seq_len: int, rotary_dim: int, base: float, scaling_factor: float,
                       original_max_position_embeddings: int, beta_fast: float = 32.0, beta_slow: float = 1.0,
                       mscale: float = 1.0, mscale_all_dim: float = 0.0, device=None):
    """cos and sin [seq_len, rotary_dim] (frequencies repeated twice), each times the concentration factor."""
    inv_freq = yarn_inv_freq(rotary_dim, base, scaling_factor, original_max_position_embeddings,
                             beta_fast, beta_slow, device)
    freqs = torch.outer(torch.arange(seq_len, dtype=torch.float32, device=device), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    factor = concentration_factor(scaling_factor, mscale, mscale_all_dim)
    return emb.cos() * factor, emb.sin() * factor
