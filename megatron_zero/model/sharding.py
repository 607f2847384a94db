"""Convert between the full (unsharded) state dict and per-TP-rank state dicts.

Forms, stated once:
* full form  — every tensor at its full shape, word embedding with the *unpadded*
  `config.vocab_size` rows (the universal-checkpoint form). `shard_state_dict`
  takes it; `gather_state_dicts` returns it.
* TP form    — what `GPTModel(config, tp_group).state_dict()` holds on one TP rank:
  TP-split tensors are that rank's contiguous slice along their partition
  dimension; the word embedding is padded to `config.padded_vocab_size(tp)` rows
  before the split.

Padded rows are never trained (their logits are excluded from the loss), so they
are zeros and re-padding is exact. The fused QKV weight is laid out per query group
(groups x [q heads, k, v] x head_dim), so its TP split is a plain contiguous dim-0 split:
with num_query_groups >= tp each rank holds whole groups; with fewer groups than ranks each
holds a piece of one group and attention all-gathers the group (Megatron's KV replication).
A tensor with `sub_params` blocks (SwiGLU's [gate; up]) is split block by block: TP rank r
holds [gate_r; up_r], so each rank has matching halves.
"""
from __future__ import annotations

from typing import Dict, List

import torch

from .config import GPTConfig
from .params import ParamSpec, param_spec


def pad_vocab(tensor: torch.Tensor, padded_rows: int) -> torch.Tensor:
    """Append zero rows so dim 0 has `padded_rows` rows."""
    extra = padded_rows - tensor.shape[0]
    if extra < 0:
        raise ValueError(f"cannot pad {tensor.shape[0]} vocabulary rows down to {padded_rows}")
    return torch.cat([tensor, tensor.new_zeros(extra, *tensor.shape[1:])]) if extra else tensor.clone()


def unpad_vocab(tensor: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Keep the first `vocab_size` rows (drop the padding)."""
    if tensor.shape[0] < vocab_size:
        raise ValueError(f"a vocabulary tensor of {tensor.shape[0]} rows has fewer than vocab_size {vocab_size}")
    return tensor[:vocab_size].clone()


def shard_tensor(full: torch.Tensor, spec: ParamSpec, config: GPTConfig, tp: int, tp_rank: int) -> torch.Tensor:
    """One TP rank's piece of a full-form tensor."""
    if tuple(full.shape) != spec.full_shape:
        raise ValueError(f"{spec.name} has shape {tuple(full.shape)} but this config expects the full "
                         f"(unpadded) shape {spec.full_shape}")
    if spec.is_vocab:
        full = pad_vocab(full, config.padded_vocab_size(tp))
    if spec.partition_dim is None:
        return full.clone()
    return split_sub_params(full, spec.partition_dim, spec.sub_params, tp, tp_rank)


def split_sub_params(full: torch.Tensor, dim: int, sub_params: int, tp: int, tp_rank: int) -> torch.Tensor:
    """TP rank tp_rank's slice of each of the `sub_params` equal blocks of `dim`, concatenated."""
    blocks = full.chunk(sub_params, dim=dim)
    size = blocks[0].shape[dim] // tp
    return torch.cat([b.narrow(dim, tp_rank * size, size) for b in blocks], dim=dim)


def merge_sub_params(shards: List[torch.Tensor], dim: int, sub_params: int) -> torch.Tensor:
    """The inverse of split_sub_params over every TP rank's slice (in TP-rank order)."""
    pieces = [s.chunk(sub_params, dim=dim) for s in shards]
    return torch.cat([p[k] for k in range(sub_params) for p in pieces], dim=dim)


def gather_tensor(shards: List[torch.Tensor], spec: ParamSpec, config: GPTConfig) -> torch.Tensor:
    """The full-form tensor from every TP rank's piece (in TP-rank order)."""
    if spec.partition_dim is None:
        full = shards[0].clone()
    else:
        full = merge_sub_params(list(shards), spec.partition_dim, spec.sub_params)
    return unpad_vocab(full, config.vocab_size) if spec.is_vocab else full


def shard_state_dict(full_sd: Dict[str, torch.Tensor], config: GPTConfig, tp: int,
                     tp_rank: int) -> Dict[str, torch.Tensor]:
    """Full form (unpadded vocab) -> TP form for rank `tp_rank` of `tp`."""
    config.check_tp(tp)
    return {name: shard_tensor(t, param_spec(name, config), config, tp, tp_rank) for name, t in full_sd.items()}


def gather_state_dicts(tp_sds: List[Dict[str, torch.Tensor]], config: GPTConfig) -> Dict[str, torch.Tensor]:
    """TP-form state dicts of ranks 0..tp-1 -> full form (unpadded vocab)."""
    names = list(tp_sds[0])
    for rank, sd in enumerate(tp_sds):
        if list(sd) != names:
            raise ValueError(f"TP rank {rank}'s state dict holds other keys than TP rank 0's")
    return {name: gather_tensor([sd[name] for sd in tp_sds], param_spec(name, config), config) for name in names}
