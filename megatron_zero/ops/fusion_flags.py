"""On/off switches for every fusion, the targets of Megatron's --no-*-fusion flags.

training/trainer.py maps the command line onto these once at start-up:

    --no-masked-softmax-fusion        -> masked_softmax_fusion = False
    --no-bias-gelu-fusion             -> bias_gelu_fusion = False
    --no-gradient-accumulation-fusion -> gradient_accumulation_fusion = False
    --no-persist-layer-norm           -> persist_layer_norm = False (LayerNorm and RMSNorm)
    --no-rope-fusion                  -> rope_fusion = False

(--no-cross-entropy-loss-fusion is no switch here: it is a model converter, model/output_loss_converter.py.)

A switch that is on only *allows* the fused kernel: an op still falls back to
PyTorch when the kernel was not built or the tensors are not on its device.
Every op also takes `fused=` to override the switch for one call.
"""
from dataclasses import dataclass, fields, replace


@dataclass(frozen=True)
class FusionFlags:
    masked_softmax_fusion: bool = True
    bias_gelu_fusion: bool = True
    # Accumulate each micro-batch's gradients into an fp32 main-grad buffer as backward
    # produces them (ZeRO stages 0/1, zero/stage12.py); stages 2/3 always reduce-scatter
    # each bucket into fp32 partitions, so there the accumulation is fp32 either way.
    gradient_accumulation_fusion: bool = True
    # Megatron's "persistent" LayerNorm variant; there is one fused LayerNorm
    # here, so this and layer_norm_fusion together decide whether it is used.
    persist_layer_norm: bool = True
    layer_norm_fusion: bool = True
    rope_fusion: bool = True
    cpu_adam_fusion: bool = True
    multi_tensor_adam_fusion: bool = True


_flags = FusionFlags()


def get_fusion_flags() -> FusionFlags:
    return _flags


def set_fusion_flags(**changes) -> FusionFlags:
    """Change some switches, e.g. set_fusion_flags(bias_gelu_fusion=False); returns the old."""
    global _flags
    known = {f.name for f in fields(FusionFlags)}
    unknown = sorted(set(changes) - known)
    if unknown:
        raise ValueError(f"unknown fusion flag(s) {unknown}; known flags are {sorted(known)}")
    old, _flags = _flags, replace(_flags, **changes)
    return old


def use_fused(flag_name: str, fused: "bool | None") -> bool:
    """The caller's explicit choice if given, else the global switch."""
    return getattr(_flags, flag_name) if fused is None else bool(fused)
