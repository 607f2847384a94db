"""FP8 for the MoE experts: each expert a linear layer of its own, on the rows routed to it.

An expert's fc1 / fc2 are ColumnParallelLinear / RowParallelLinear (the dense MLP's classes, their weights
marked `expert_parallel`), so the converter turns them into their Float8 classes as it does a block's,
each with its own Float8Matmul: the expert's weight and its input rows (and output gradient) each get their
own scale, as if the expert were one linear layer on every token the micro-batch routed to it. Where the
rows come from decides the groups its amaxes reduce over (the converter passes them):

- the expert-tensor-parallel group splits the expert's weight (fc1 by output, fc2 by input), as TP splits
  a block's layer: it is the layer's own `tp_group`, reduced as matmul.py does for a TP split;
- the tokens: the expert-parallel exchange already brings the owner every row routed to its experts from
  the whole EP group (and expert TP all-gathers the rows of its group), so what is missing are the rows
  the expert's replicas in the expert-data-parallel group received. The EDP group thus takes CP's place
  for the tokens (x and g, tensorwise or along the token axis): the scale is that of every token of the
  stage's micro-batch routed to the expert, whatever EP, ETP, CP or SP split them over. The block's CP
  and DP groups are wrong here: their ranks can hold other experts.
- delayed scaling needs no further DP reduction (the replicas of the weight are equal).

The grouped-GEMM (`--moe-grouped-gemm`) and expert-TP paths multiply the experts' weights themselves
(moe/grouped_mlp.py, moe/expert_tp.py); with FP8 they call grouped_mlp's `float8_experts_linear`: each expert's
Float8Matmul on its run of rows, one after another. torchao 0.18 has no public FP8 grouped GEMM for
training (its moe_training grouped GEMM is a prototype, rowwise e4m3 only), so the experts' GEMMs are
per-expert torchao GEMMs, the same sums as the experts' own layers compute. An expert with no rows still
casts (amax 0) and joins each reduction, so every rank issues the same collectives.

The expert's GEMMs pad their inner dimension to 16 (torchao's `pad_inner_dim`): the weight gradient's
inner dimension is the expert's row count, which routing does not keep a multiple of 16 as FP8 GEMMs need.
"""
from __future__ import annotations

import dataclasses

import torch


def is_expert(module: torch.nn.Module) -> bool:
    """Whether a linear layer is an MoE expert's (its weight marked expert_parallel by moe/layer.py)."""
    return bool(getattr(module.weight, "expert_parallel", False))


def expert_config(config):
    """torchao's Float8LinearConfig for an expert's GEMMs: the block's, the inner dimension padded to 16."""
    return dataclasses.replace(config, pad_inner_dim=True)
