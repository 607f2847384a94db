"""SwiGLU, the activation of Llama's MLP and of its experts (no compiled kernel: the PyTorch expression)."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def swiglu(x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for x = [gate, up] on the last dimension (Megatron's SwiGLU)."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
