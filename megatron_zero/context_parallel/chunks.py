"""Which tokens a context-parallel rank holds: Megatron's causal load balancing, as pure functions.

The sequence of length s is cut into 2 * CP chunks of s / (2 CP) tokens; CP rank r holds chunks r and
2 CP - 1 - r, in that order, as one local sequence of s / CP tokens. Under a causal mask chunk i costs
i + 1 units of attention work, so every rank does (r + 1) + (2 CP - r) = 2 CP + 1 units: balanced.

    CP = 2, s = 8:  chunks  [0 1][2 3][4 5][6 7]
                    rank 0  [0 1]            [6 7]   positions 0 1 6 7
                    rank 1       [2 3][4 5]          positions 2 3 4 5

Every per-token input of the model (tokens, labels, loss mask, position ids) is sliced the same way
(`slice_batch_for_cp`); the model takes the positions from `cp_positions` (learned position
embedding, RoPE, the causal mask between chunks).
"""
from __future__ import annotations

import torch


def chunk_size(seq_length: int, cp: int) -> int:
    if seq_length % (2 * cp):
        raise ValueError(f"sequence length {seq_length} is not a multiple of 2 x context-parallel size {cp}")
    return seq_length // (2 * cp)


def cp_positions(seq_length: int, cp: int, cp_rank: int, device=None) -> torch.Tensor:
    """The positions (0..seq_length-1) of the tokens CP rank `cp_rank` holds, in its local order."""
    c = chunk_size(seq_length, cp)
    first = torch.arange(cp_rank * c, (cp_rank + 1) * c, device=device)
    second = torch.arange((2 * cp - 1 - cp_rank) * c, (2 * cp - cp_rank) * c, device=device)
    return torch.cat([first, second])


def slice_sequence_for_cp(t: torch.Tensor, cp: int, cp_rank: int, dim: int = 1) -> torch.Tensor:
    """This CP rank's two chunks of `t` along `dim` (the sequence), concatenated."""
    if cp == 1:
        return t
    c = chunk_size(t.shape[dim], cp)
    return torch.cat([t.narrow(dim, cp_rank * c, c), t.narrow(dim, (2 * cp - 1 - cp_rank) * c, c)], dim=dim)


def slice_batch_for_cp(batch: dict, cp: int, cp_rank: int) -> dict:
    """A collated micro-batch (tokens, labels, loss_mask, position_ids: [b, s]) cut to this CP rank's tokens."""
    return {k: slice_sequence_for_cp(v, cp, cp_rank) if torch.is_tensor(v) and v.dim() >= 2 else v
            for k, v in batch.items()}
