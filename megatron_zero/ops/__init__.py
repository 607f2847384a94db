"""Python faces of the csrc/ kernels, each with a PyTorch fallback of the same meaning.

Which kernels this installation has: `available_kernels()`. Switches that turn
a fusion off (Megatron's --no-*-fusion flags): `set_fusion_flags(...)`.
"""
from .bias_gelu import bias_gelu
from .cpu_adam import CPUAdamW, adamw_step_
from .fused_adam import MultiTensorAdamW, multi_tensor_adamw_
from .fusion_flags import FusionFlags, get_fusion_flags, set_fusion_flags
from .layer_norm import LayerNorm, layer_norm
from .registry import available_kernels
from .softmax import scaled_upper_triang_masked_softmax

__all__ = [
    "CPUAdamW", "FusionFlags", "LayerNorm", "MultiTensorAdamW", "adamw_step_", "available_kernels", "bias_gelu",
    "get_fusion_flags", "layer_norm", "multi_tensor_adamw_", "scaled_upper_triang_masked_softmax",
    "set_fusion_flags",
]
