"""FP8 training through torchao's float8: Megatron-LM's --fp8-* flags, applied as a model converter.

flags.py declares and checks the flags; settings.py maps them onto torchao's Float8LinearConfig and
refuses a device without FP8 tensor cores (unless emulated); convert.py swaps the blocks' tensor-parallel
linear layers for their FP8 classes (layers.py), whose matmul (matmul.py) reduces each scale's amax over
the groups that split its tensor. docs/fp8.md says what each flag maps to. Only convert.py and what it
imports need torchao; the flags and settings import without it. What importing torchao logs that is not
ours (its CUDA extensions on a CPU, torch's pytree deprecation) is dropped here, once (import_noise.py).
"""
from .import_noise import drop_torchao_import_noise

drop_torchao_import_noise()  # before any module of this package imports torchao
