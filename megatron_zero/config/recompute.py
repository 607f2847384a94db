"""Megatron-LM's recompute switches beside --recompute-granularity (model/recompute.py; docs/parallelism.md):
--recompute-activations (its selective recompute) and --moe-layer-recompute (each MoE layer run again in
backward, Megatron-Core's moe_layer_recompute). Checked before config/model.py's check_recompute, which then
sees the granularity they set."""
from __future__ import annotations

import argparse

from .errors import require
from .fields import add_section_flags, flag, section

RECOMPUTE = "recompute (Megatron-LM's switches)"


@section(RECOMPUTE)
class RecomputeConfig:
    """The recompute switches Megatron-LM's launch scripts give instead of --recompute-granularity."""
    recompute_activations: bool = flag(
        "Megatron-LM's selective recompute: --recompute-granularity selective (the attention core runs again in "
        "backward)", False, action="store_true")
    moe_layer_recompute: bool = flag(
        "each MoE layer (router, dispatch, experts, shared expert) runs again in backward, keeping only its input; "
        "as Megatron-Core, it makes the granularity selective (the attention core recomputed too)", False,
        action="store_true")


def add_flags(p: argparse.ArgumentParser) -> None:
    add_section_flags(p, RecomputeConfig)


def check(args) -> None:
    """Each switch as the granularity it means, refusing a contradiction in one sentence."""
    if args.recompute_activations:
        require(args.recompute_granularity in (None, "selective"),
                "--recompute-activations is Megatron-LM's --recompute-granularity selective; it contradicts "
                f"--recompute-granularity {args.recompute_granularity}")
        args.recompute_granularity = "selective"
    if args.moe_layer_recompute:
        experts = args.num_experts[0] if isinstance(args.num_experts, (list, tuple)) else args.num_experts
        require(experts not in (None, 1), "--moe-layer-recompute recomputes the MoE layers, and this model has none "
                "(give --num-experts, or drop the flag)")
        require(args.recompute_granularity != "full" and not args.checkpoint_activations,
                "--moe-layer-recompute is selective recompute (Megatron-Core refuses it with full granularity); drop "
                "it or --recompute-granularity full / --checkpoint-activations, which recompute MoE layers already")
        args.recompute_granularity = "selective"
