"""Activation recomputation: Megatron's --recompute-granularity / --recompute-method / --recompute-num-layers.

    selective   the attention core (q, k, v -> context) runs again in backward, so its
                [b, heads, s, s] activations are never kept; the rest of each layer keeps its own
    full        whole transformer layers run again in backward; only their inputs are kept:
      uniform     the stage's layers in chunks of N, each chunk keeping only its input
      block       the first N layers of the stage one by one; the others keep everything

Built on torch.utils.checkpoint (use_reentrant=False), which restores the default CPU and
device generators for the recompute (preserve_rng_state). `checkpoint` (tensor_parallel/random.py) restores the
TP RNG tracker's states as well, so dropout drawn inside `get_rng_tracker().fork()`
(attention dropout, sequence-parallel dropout) draws the same masks on recompute: the
gradients equal those without recomputation (tests/test_model_recompute.py). While a recompute
runs, `is_recomputing()` is true: what a layer records for the log (the MoE losses) is recorded once.
"""
from __future__ import annotations

from typing import Callable, List, Sequence, Tuple

import torch
from torch import nn

from ..tensor_parallel.random import checkpoint

def layer_segments(num_layers: int, method: str, recompute_num_layers: int) -> List[Tuple[int, int, bool]]:
    """(start, end, recompute) runs of a stage's `num_layers` layers for full recomputation."""
    n = recompute_num_layers
    if method == "uniform":
        return [(a, min(a + n, num_layers), True) for a in range(0, num_layers, n)]
    if method == "block":
        first = min(n, num_layers)
        return [(a, a + 1, True) for a in range(first)] + ([(first, num_layers, False)] if first < num_layers else [])
    raise ValueError(f"recompute_method {method!r} is not 'uniform' or 'block'")


def _run(layers: Sequence[nn.Module]) -> Callable:
    def forward(x):
        for layer in layers:
            x = layer(x)
        return x
    return forward


def run_layers(layers: Sequence[nn.Module], x: torch.Tensor, config) -> torch.Tensor:
    """Run a stage's transformer layers in order, recomputing them as `config` asks."""
    if config.recompute_granularity != "full":
        return _run(layers)(x)
    for start, end, recompute in layer_segments(len(layers), config.recompute_method, config.recompute_num_layers):
        segment = _run(layers[start:end])
        x = checkpoint(segment, x) if recompute else segment(x)
    return x
