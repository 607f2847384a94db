"""Muon as Megatron-LM spells it (`--optimizer muon|dist_muon`, the `--muon-*` flags; Megatron-Core 0.16.1's
`TensorParallelMuon` over emerging-optimizers' OrthogonalizedOptimizer): which parameters take it, and one
matrix's update.

Which parameters: the 2-D weight matrices of the transformer blocks (QKV, attention output, the MLP's and every
expert's and shared expert's two matrices); AdamW, with the usual flags, steps the rest: the word and position
embeddings, the output layer, norms, biases, the MoE router and the shared expert's gate (Megatron-Core sends
every 2-D non-embedding weight to Muon, the router's too; here the router stays with AdamW, as Moonlight and
Kimi K2 keep it).

One step of a Muon matrix W with gradient G (momentum m, the state, saved as Adam's `exp_avg` is):

    W *= 1 - lr wd                                  (decoupled weight decay)
    m = mu m + (1 - mu) G                           (m.lerp_(G, 1 - mu))
    D = G + mu (m - G) if --muon-use-nesterov else m
    W -= lr * extra * scale(rows, cols) * NS(D)     (newton_schulz.py; QKV as three matrices, below)

With `--muon-split-qkv` (the default) the fused QKV weight, per query group [q heads, k, v], is orthogonalized as
three matrices, Q (every group's q rows), K and V, each scaled by its own shape (Megatron-Core's split).
Under tensor parallelism (`--muon-tp-mode`): `blockwise` orthogonalizes each rank's shard as a matrix of its own
(scaled by the shard's shape: Megatron-Core's blockwise); `duplicated` gathers the whole matrix over TP, every TP
rank orthogonalizes it and keeps its shard (one process's result); `distributed` keeps the shards and sums each
iteration's Gram matrix over TP (one process's result up to the order of the sums). An expert's matrices are its
own and split over the expert-TP group.

Where torch.optim.Muon's definitions coincide: its update is this one with `--muon-scale-mode shape_scaling`
(its adjust_lr_fn "original"), Nesterov, its (a, b, c) equal to Megatron's for every step taken (one step of the
quintic set) and the iteration in bf16 (`--muon-fp32-matmul-prec medium`); it differs in normalizing in bf16
(here in fp32 before the cast) and in using one (a, b, c) for every step where Megatron-Core cycles five.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from ..distributed import shm_comm
from ..model.params import (BLOCK_PARAMS, MOE_ROUTER_SUFFIX, MTP_LAYER_PREFIX, MTP_PROJECTION,
                            SHARED_EXPERT_GATE_SUFFIX, parse_expert_suffix, parse_mtp_suffix)
from . import newton_schulz
from .newton_schulz import matmul_precision, orthogonalize, scale_factor

TP_MODES = ("blockwise", "duplicated", "distributed")
QKV_SUFFIX = "self_attention.query_key_value.weight"


@dataclass(frozen=True)
class MuonSettings:
    """The `--muon-*` flags, and the QKV split's rows per query group (q heads x head dim, head dim, head dim)."""
    momentum: float = 0.95
    nesterov: bool = False
    split_qkv: bool = True
    scale_mode: str = "spectral"
    fp32_matmul_prec: str = "medium"
    num_ns_steps: int = 5
    tp_mode: str = "blockwise"
    extra_scale_factor: float = 1.0
    qkv_split_rows: tuple = ()  # (q rows, k rows, v rows) per query group; () without attention to split

    def __post_init__(self):
        if self.tp_mode not in TP_MODES:
            raise ValueError(f"Muon's TP mode must be one of {TP_MODES}, got {self.tp_mode!r}")
        newton_schulz.scale_factor(1, 1, self.scale_mode)
        if self.num_ns_steps < 1:
            raise ValueError(f"Muon needs at least one Newton-Schulz step, got {self.num_ns_steps}")


def block_matrix_dim(name: str) -> Optional[int]:
    """The TP split dimension (0: column-parallel, 1: row-parallel) of a block's 2-D weight that takes Muon, or
    None for a parameter AdamW steps."""
    index, _, suffix = name.partition(".")
    if not index.isdigit() or suffix in (MOE_ROUTER_SUFFIX, SHARED_EXPERT_GATE_SUFFIX):
        return None
    depth = parse_mtp_suffix(suffix)  # a multi-token prediction depth's: its projection, and its block's as a block's
    if depth is not None:
        if depth[1] == MTP_PROJECTION:
            return 0
        return block_matrix_dim(f"{index}.{depth[1][len(MTP_LAYER_PREFIX):]}") \
            if depth[1].startswith(MTP_LAYER_PREFIX) else None
    expert = parse_expert_suffix(suffix)
    if expert is not None:
        suffix = expert[1]
    elif suffix.startswith("mlp.shared_expert."):
        suffix = "mlp." + suffix[len("mlp.shared_expert."):]
    if not suffix.endswith(".weight") or suffix not in BLOCK_PARAMS:
        return None
    dim = BLOCK_PARAMS[suffix][0]
    return dim  # the norms' weights are replicated (None)


def takes_muon(name: str, shape) -> bool:
    return len(shape) == 2 and block_matrix_dim(name) is not None


def is_qkv(name: str) -> bool:
    """A block's fused QKV weight (a multi-token prediction depth's block's too)."""
    suffix = name.partition(".")[2]
    return suffix == QKV_SUFFIX or suffix.endswith("." + MTP_LAYER_PREFIX + QKV_SUFFIX)


def qkv_pieces(d: torch.Tensor, split_rows) -> list:
    """Q, K and V of a fused QKV matrix laid out per query group (Megatron-Core's split)."""
    groups = d.shape[0] // sum(split_rows)
    return [t.reshape(-1, d.shape[1]) for t in torch.split(d.view(groups, sum(split_rows), -1), list(split_rows), 1)]


def qkv_joined(pieces, shape, split_rows) -> torch.Tensor:
    groups = shape[0] // sum(split_rows)
    return torch.cat([t.view(groups, -1, shape[1]) for t in pieces], dim=1).view(shape)


def matrices(name: str, shape, settings: MuonSettings, tp: int = 1):
    """The (rows, cols) of the matrices a parameter's update orthogonalizes (its QKV pieces, or itself), as the
    TP mode sees them (whole under duplicated/distributed, the shard under blockwise); for the FLOPs balance."""
    dim = block_matrix_dim(name)
    rows, cols = shape
    whole = settings.tp_mode != "blockwise" and tp > 1
    if settings.split_qkv and is_qkv(name) and settings.qkv_split_rows:
        groups = rows // sum(settings.qkv_split_rows)
        out = [(groups * r, cols) for r in settings.qkv_split_rows]
    else:
        out = [(rows, cols)]
    if whole and dim is not None:
        out = [(r * tp, c) if dim == 0 else (r, c * tp) for r, c in out]
    return out


def ns_flops(name: str, shape, settings: MuonSettings, tp: int = 1) -> int:
    return sum(newton_schulz.flops(r, c, settings.num_ns_steps) for r, c in matrices(name, shape, settings, tp))


def orthogonalized_update(name: str, d: torch.Tensor, settings: MuonSettings, tp_group=None) -> torch.Tensor:
    """extra x scale x NS(d) of one parameter's update direction `d` (this TP rank's shard of it, fp32), QKV
    split per query group; `tp_group`: the group its shards are split over (None or one rank: whole)."""
    tp = dist.get_world_size(tp_group) if tp_group is not None else 1
    dim = block_matrix_dim(name) if tp > 1 else None
    with matmul_precision(settings.fp32_matmul_prec):
        if settings.split_qkv and is_qkv(name) and settings.qkv_split_rows:
            pieces = [_scaled(p, dim, settings, tp_group, tp) for p in qkv_pieces(d, settings.qkv_split_rows)]
            return qkv_joined(pieces, d.shape, settings.qkv_split_rows)
        return _scaled(d, dim, settings, tp_group, tp)


def _scaled(x: torch.Tensor, dim: Optional[int], settings: MuonSettings, tp_group, tp: int) -> torch.Tensor:
    size = list(x.shape)
    steps = settings.num_ns_steps
    if dim is None or settings.tp_mode == "blockwise":
        out = orthogonalize(x, steps)
    elif settings.tp_mode == "duplicated":
        size[dim] *= tp
        shards = [torch.empty_like(x).reshape(-1) for _ in range(tp)]
        shm_comm.all_gather(shards, x.contiguous().reshape(-1), tp_group)
        whole = torch.cat([s.view(x.shape) for s in shards], dim=dim)
        out = orthogonalize(whole, steps).chunk(tp, dim=dim)[dist.get_rank(tp_group)]
    else:  # distributed: the Gram matrices summed over TP (the shards are the transposed matrix's columns)
        size[dim] *= tp
        out = orthogonalize(x, steps, transpose=dim == 0, tp_group=tp_group)
    return out * (scale_factor(size[0], size[1], settings.scale_mode) * settings.extra_scale_factor)


def optimizer_switch(saved_args: dict, optimizer: str, directory: str) -> Optional[str]:
    """The line a resume says when the checkpoint's optimizer (its args' --optimizer; none recorded: Adam) is
    another family than this run's (AdamW or Muon), whose state cannot carry over; None when they agree."""
    saved = saved_args.get("optimizer") or "adamw"
    muon_here, muon_there = optimizer in ("muon", "dist_muon"), saved in ("muon", "dist_muon")
    if muon_here == muon_there:
        return None
    return (f"the checkpoint {directory} was trained with --optimizer {saved} and this run uses --optimizer "
            f"{optimizer}: its weights load, the optimizer starts fresh")
