"""megatron_zero: Megatron-style 3D-parallel GPT training with ZeRO and reshapable checkpoints."""

__version__ = "0.1.0"
