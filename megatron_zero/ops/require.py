"""Which compiled kernels training on a device uses, and the refusal when one is missing.

    CUDA device  megatron_zero._C_cuda (LayerNorm, RMSNorm, RoPE, causal softmax, bias-GeLU,
                 multi-tensor AdamW), and megatron_zero._C_cpu_adam when the optimizer is offloaded
    CPU device   megatron_zero._C_cpu_ops (bias-GeLU, causal softmax, RMSNorm, cross-entropy exp)
                 and megatron_zero._C_cpu_adam (every AdamW step on the CPU)

Without --require-fused-kernels a missing kernel is a PyTorch fallback and a line in the start-up
log (registry.kernel_report); with it, `require_fused_kernels` refuses to start in one sentence
naming the missing kernels, why each is missing and how to build them.
"""
from __future__ import annotations

from typing import Dict, List

import torch

from ..distributed.device import DeviceError
from .registry import CPU_OPS_EXT, CUDA_EXT, EXTENSIONS, available_kernels

CPU_ADAM_EXT = "megatron_zero._C_cpu_adam"


class MissingKernelsError(DeviceError):
    """--require-fused-kernels was given and a kernel the device uses is not built (one sentence)."""


def required_extensions(device: torch.device, offload: bool) -> List[str]:
    """The extension modules training on `device` uses (offload: the optimizer steps on the host)."""
    if device.type == "cuda":
        return [CUDA_EXT] + ([CPU_ADAM_EXT] if offload else [])
    return [CPU_OPS_EXT, CPU_ADAM_EXT]


def missing_kernels(device: torch.device, offload: bool) -> Dict[str, str]:
    """{kernel: why it is unavailable} among the kernels training on `device` uses; empty when all are there."""
    status = available_kernels()
    return {k: status[k] for ext in required_extensions(device, offload) for k in EXTENSIONS[ext]
            if status[k] is not True}


def require_fused_kernels(device: torch.device, offload: bool) -> None:
    """Raise MissingKernelsError naming every kernel `device` would run in PyTorch instead."""
    missing = missing_kernels(device, offload)
    if not missing:
        return
    by_reason: Dict[str, List[str]] = {}
    for kernel, why in missing.items():
        by_reason.setdefault(why, []).append(kernel)
    what = "; ".join(f"{', '.join(ks)} ({why})" for why, ks in by_reason.items())
    raise MissingKernelsError(
        f"--require-fused-kernels: training on {device} needs kernels that are not available: {what}; build "
        "them against this torch with `pip install --no-build-isolation .` (or `python setup.py build_ext "
        "--inplace` in a checkout), or drop --require-fused-kernels to train with the PyTorch fallbacks")
