"""Layout-independent weight initialisation.

Each full (unsharded, unpadded) weight is drawn on the host from a generator seeded
with `config.seed` plus a stable hash of the parameter's name; a TP rank then
keeps its slice. The same seed therefore gives the same full model whatever the
TP or PP layout. Megatron's init: normal(0, std) for weights, std / sqrt(2L) for
output projections (attention dense, dense_4h_to_h), zeros for biases, ones and
zeros for layer norms. Padded vocabulary rows are zero.
"""
from __future__ import annotations

import hashlib
import math

import torch

from ..distributed.device import HOST
from .config import GPTConfig
from .params import param_spec
from .sharding import shard_tensor


def name_seed(seed: int, name: str) -> int:
    digest = hashlib.sha256(name.encode()).digest()
    return (seed + int.from_bytes(digest[:7], "little")) % (1 << 63)


def full_init_tensor(name: str, config: GPTConfig) -> torch.Tensor:
    """The initial full-form value of one parameter (fp32, on the host; the caller copies its slice to the device)."""
    spec = param_spec(name, config)
    if spec.init == "zeros":
        return torch.zeros(spec.full_shape, device=HOST)
    if spec.init == "ones":
        return torch.ones(spec.full_shape, device=HOST)
    std = config.init_method_std
    if spec.init == "scaled_normal":
        std = std / math.sqrt(2.0 * config.num_layers)
    gen = torch.Generator(device=HOST).manual_seed(name_seed(config.seed, name))
    return torch.randn(spec.full_shape, generator=gen, device=HOST) * std


@torch.no_grad()
def initialize_parameters(model: torch.nn.Module, config: GPTConfig, tp: int, tp_rank: int) -> None:
    """Fill every parameter of `model` with its TP rank's slice of the full initial weights (an expert's:
    its expert-tensor-parallel rank's slice, moe/layer.py)."""
    for name, param in model.named_parameters():
        split = (getattr(param, "expert_tp_size", tp), getattr(param, "expert_tp_rank", tp_rank))
        local = shard_tensor(full_init_tensor(name, config), param_spec(name, config), config, *split)
        param.copy_(local)
