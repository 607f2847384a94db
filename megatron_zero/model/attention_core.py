"""The attention core, softmax(q k^T / sqrt(d), causal) -> dropout -> @ v, by one of four backends.

    unfused  q @ k^T, the causal softmax of megatron_zero.ops (its kernel, CUDA or fp32 CPU, only where
             --no-masked-softmax-fusion does not forbid it and it is built), dropout, @ v:
             the path this model always had; it builds the [b, heads, s, s] matrix
    fused    the same with the fused causal-softmax kernel asked for even where
             --no-masked-softmax-fusion is given; ops falls back to PyTorch where the kernel
             is not built (warning once). On the CPU in fp32 without dropout it runs by query
             blocks that skip the keys they cannot see (block_causal_attention.py: 5/8 of
             the s x s work at 4 blocks)
    flash    torch.nn.functional.scaled_dot_product_attention restricted to the kernels that
             never build the s x s matrix (flash; memory-efficient): O(s) activation memory
    auto     scaled_dot_product_attention with torch's kernel choice, where it applies (below);
             on the CPU in fp32 without dropout and with s <= BLOCKED_MAX_SEQ, `fused`'s query
             blocks (where the kernel is built and --no-masked-softmax-fusion is not given),
             which measured faster than the CPU flash kernel there (BENCHMARKS.md) while their
             saved probabilities stay small (5 MiB a layer at b 4, 8 heads, s 256)

Attention dropout works on TP-sharded heads, so every backend draws its mask inside the
RNG tracker's fork (a per-TP-rank stream that recomputation restores; model/recompute.py).
SDPA draws the mask from the default generator of the tensors' device, which inside the
fork holds the tracker's state, so its masks are reproducible and replayed on recompute;
they are not the unfused path's masks (another draw order), so backends agree exactly
only with dropout off. Where SDPA applies: with the dropout inactive (p = 0 or eval) on
any device, and on CUDA (whose flash / memory-efficient kernels implement dropout). On
other devices torch has no fused kernel with dropout (it would fall back to its own s x s
math kernel), so `auto` runs `unfused` there while attention dropout is active, and
`flash` is refused with attention dropout on a machine without CUDA (config/model.py).
"""
from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from ..ops.fusion_flags import use_fused
from ..ops.registry import CPU_OPS_EXT, extension_for, load
from ..tensor_parallel import get_rng_tracker
from . import functional
from .block_causal_attention import block_causal_attention

NO_SXS_KERNELS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]
BLOCKED_MAX_SEQ = 256  # `auto` on the CPU: query blocks up to this length, flash beyond (a tie at 512)
QUERY_BLOCK = 64


def sdpa_has_dropout_kernel(device: torch.device) -> bool:
    """Whether torch's flash / memory-efficient SDPA kernels implement dropout on `device`."""
    return device.type == "cuda"


def resolve_backend(backend: str, dropout_active: bool, device: torch.device) -> str:
    """The backend that actually runs: `auto` becomes 'sdpa' or 'unfused' (see the module docstring)."""
    if backend == "auto":
        return "sdpa" if not dropout_active or sdpa_has_dropout_kernel(device) else "unfused"
    return backend


def _softmax_path(q, k, v, dropout_p, fused):
    scale = 1.0 / math.sqrt(q.shape[-1])
    probs = functional.scaled_upper_triang_masked_softmax(q @ k.transpose(-2, -1), scale, fused=fused)
    if dropout_p > 0:
        with get_rng_tracker().fork():  # heads differ per TP rank: draw per-rank masks
            probs = F.dropout(probs, dropout_p, True)
    return probs @ v


def _sdpa(q, k, v, dropout_p, kernels=None):
    restrict = sdpa_kernel(kernels) if kernels else contextlib.nullcontext()
    fork = get_rng_tracker().fork() if dropout_p > 0 else contextlib.nullcontext()
    with restrict, fork:
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)


def _blocked_kernel(q, backend: str, dropout_p: float):
    """The CPU kernel module when this call runs by query blocks (see the module docstring), else None."""
    if dropout_p > 0 or backend not in ("fused", "auto") or q.device.type != "cpu" or q.dtype != torch.float32:
        return None
    if backend == "fused":  # asked for: warns once when the kernel is not built
        return extension_for("scaled_upper_triang_masked_softmax", q)
    short = q.shape[-2] <= BLOCKED_MAX_SEQ and use_fused("masked_softmax_fusion", None)
    return load(CPU_OPS_EXT) if short else None


def attention_core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, backend: str, dropout_p: float,
                   training: bool) -> torch.Tensor:
    """Causal attention of q, k, v [b, heads, s, head_dim] -> context [b, heads, s, head_dim]."""
    p = dropout_p if training else 0.0
    ext = _blocked_kernel(q, backend, p)
    if ext is not None:
        return block_causal_attention(q, k, v, 1.0 / math.sqrt(q.shape[-1]), QUERY_BLOCK, ext)
    which = resolve_backend(backend, p > 0, q.device)
    if which == "sdpa":
        return _sdpa(q, k, v, p)
    if which == "flash":
        return _sdpa(q, k, v, p, NO_SXS_KERNELS)
    return _softmax_path(q, k, v, p, fused=True if which == "fused" else None)
