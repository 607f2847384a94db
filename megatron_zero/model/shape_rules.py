"""The model's shape rules, each written once, in the flags' words: the command line (config/model.py) and
GPTConfig (a model built from a checkpoint's saved arguments or by a tool) ask the same functions, so a model
the flags accept is one GPTConfig accepts and the other way round.

    heads_split, ffn_split, query_groups_split, qkv_split, sequence_split   what a tensor-parallel size needs
    head_dim_given, query_groups, rotary_percent_range, rope_pairs,
    positions, full_recompute_method                                         what holds at any size
    expert_ffn_split, shared_expert_split, shared_expert_gate,
    capacity_padding, one_capacity, capacity_gating_topk, capacity_factors  the MoE layers' shapes and capacities

Each raises ModelShapeError with one sentence; config.validate reports it as the command line's refusal.
"""
from __future__ import annotations

from typing import Optional


class ModelShapeError(ValueError):
    """A model shape that cannot be built (one sentence, naming the flags)."""


def _require(ok: bool, sentence: str) -> None:
    if not ok:
        raise ModelShapeError(sentence)


def heads_split(heads: int, tp: int) -> None:
    _require(heads % tp == 0, f"--num-attention-heads {heads} is not divisible by --tensor-model-parallel-size {tp}")


def head_dim_given(hidden: int, heads: int, kv_channels: Optional[int]) -> None:
    """The head dimension: --kv-channels, or --hidden-size split evenly over the heads."""
    _require(kv_channels is not None or hidden % heads == 0,
             f"--hidden-size {hidden} is not divisible by --num-attention-heads {heads}; give the head dimension "
             "with --kv-channels")
    _require(kv_channels is None or kv_channels >= 1, f"--kv-channels {kv_channels} must be at least 1")


def ffn_split(ffn: int, tp: int) -> None:
    _require(ffn >= 1 and ffn % tp == 0,
             f"--ffn-hidden-size {ffn} is not a positive multiple of --tensor-model-parallel-size {tp}")


def query_groups(heads: int, groups: int) -> None:
    _require(groups >= 1 and heads % groups == 0,
             f"--num-attention-heads {heads} is not divisible by --num-query-groups {groups}")


def query_groups_split(groups: int, tp: int) -> None:
    _require((groups % tp if groups >= tp else tp % groups) == 0,
             f"--num-query-groups {groups} and --tensor-model-parallel-size {tp} must divide one another "
             "(fewer groups than TP ranks replicate each group's key/value heads)")


def qkv_split(heads: int, groups: int, head_dim: int, tp: int) -> None:
    _require((heads + 2 * groups) * head_dim % tp == 0,
             f"the fused QKV size ({heads} + 2 x {groups} groups) x head dim {head_dim} is not divisible by "
             f"--tensor-model-parallel-size {tp}")


def rotary_percent_range(percent: float) -> None:
    _require(0 < percent <= 1, f"--rotary-percent {percent} must lie in (0, 1]")


def rope_pairs(percent: float, head_dim: int) -> None:
    """RoPE rotates pairs of features: the rotated share of a head is even."""
    _require(int(head_dim * percent) % 2 == 0,
             f"--rotary-percent {percent} of head dim {head_dim} rotates an odd number of features; RoPE rotates "
             "pairs")


def positions(seq_length: int, max_positions: int) -> None:
    _require(seq_length <= max_positions,
             f"--seq-length {seq_length} is longer than --max-position-embeddings {max_positions}")


def full_recompute_method(granularity: Optional[str], method: Optional[str]) -> None:
    _require(granularity != "full" or method is not None,
             "--recompute-granularity full needs --recompute-method uniform or block")


def sequence_split(seq_length: int, tp: int, sequence_parallel: bool) -> None:
    _require(not sequence_parallel or seq_length % tp == 0,
             f"--sequence-parallel splits --seq-length {seq_length} over --tensor-model-parallel-size {tp}, which "
             "does not divide it")


# mixture of experts (the expert count's rule: moe/expert_counts.py, asked by config/moe.py alone)

def expert_ffn_split(moe_ffn: int, etp: int, etp_is_tp: bool) -> None:
    _require(moe_ffn >= 1 and moe_ffn % etp == 0,
             f"--moe-ffn-hidden-size {moe_ffn} is not a positive multiple of --expert-tensor-parallel-size {etp}"
             + (" (default: --tensor-model-parallel-size)" if etp_is_tp else ""))


def shared_expert_gate(gate: bool, shared: Optional[int]) -> None:
    _require(not gate or shared is not None,
             "--moe-shared-expert-gate gates the shared expert; give --moe-shared-expert-intermediate-size")


def shared_expert_split(shared: Optional[int], tp: int) -> None:
    _require(shared is None or (shared >= 1 and shared % tp == 0),
             f"--moe-shared-expert-intermediate-size {shared} is not a positive multiple of "
             f"--tensor-model-parallel-size {tp}")


def capacity_padding(pad: bool, expert_capacity: Optional[float]) -> None:
    _require(not pad or expert_capacity is not None,
             "--moe-pad-expert-input-to-capacity pads to the capacity --moe-expert-capacity-factor sets; give it too")


def one_capacity(expert_capacity: Optional[float], gating_capacity: Optional[float]) -> None:
    """Megatron-Core's capacity or DeepSpeed-MoE's capacity gating, not both."""
    _require(expert_capacity is None or gating_capacity is None,
             "--moe-expert-capacity-factor (Megatron-Core's capacity) and DeepSpeed-MoE's capacity gating flags "
             "(--moe-train-capacity-factor, --topk, ...) configure two different routers; give one family")


def capacity_gating_topk(k: int) -> None:
    _require(k in (1, 2), f"--topk {k}: DeepSpeed-MoE's capacity gating here routes to 1 or 2 experts (its top-k "
             "gating for k > 2 is not implemented)")


def capacity_factors(train: float, evaluation: float, min_capacity: int) -> None:
    _require(train > 0 and evaluation > 0 and min_capacity >= 0,
             f"--moe-train-capacity-factor {train} and --moe-eval-capacity-factor {evaluation} must be positive, "
             f"--moe-min-capacity {min_capacity} not negative")
