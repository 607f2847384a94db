"""The positions of this rank's tokens (RoPE and learned position tables read them)."""
from __future__ import annotations

import torch

from ..context_parallel import cp_positions
from ..tensor_parallel.utils import tp_rank_in, tp_world_size


def local_positions(local_seq: int, cp_group, device) -> torch.Tensor:
    """Positions of this rank's tokens: 0..s-1, or with context parallelism its two chunks' positions."""
    if cp_group is None:
        return torch.arange(local_seq, device=device)
    cp = tp_world_size(cp_group)
    return cp_positions(local_seq * cp, cp, tp_rank_in(cp_group), device)
