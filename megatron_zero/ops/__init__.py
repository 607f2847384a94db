"""Python faces of the csrc/ kernels, each with a PyTorch fallback of the same meaning.

Which kernels this installation has: `available_kernels()`. Refusing to start
without the kernels a device uses: `require_fused_kernels(...)`. Switches that turn
a fusion off (Megatron's --no-*-fusion flags): `set_fusion_flags(...)`.
"""
from .bias_gelu import bias_gelu
from .cpu_adam import CPUAdamW, adamw_step_
from .fused_adam import MultiTensorAdamW, multi_tensor_adamw_
from .fusion_flags import FusionFlags, get_fusion_flags, set_fusion_flags
from .layer_norm import layer_norm
from .registry import available_kernels, kernel_report
from .require import MissingKernelsError, require_fused_kernels
from .rms_norm import rms_norm
from .rope import apply_rotary_pos_emb, rotary_tables
from .softmax import scaled_upper_triang_masked_softmax
from .swiglu import swiglu

__all__ = [
    "CPUAdamW", "FusionFlags", "MissingKernelsError", "MultiTensorAdamW", "adamw_step_", "apply_rotary_pos_emb",
    "available_kernels", "bias_gelu", "get_fusion_flags", "kernel_report", "layer_norm", "multi_tensor_adamw_",
    "require_fused_kernels", "rms_norm", "rotary_tables", "scaled_upper_triang_masked_softmax", "set_fusion_flags",
    "swiglu",
]
