"""DeepSeek-V3's router flags as Megatron-Core spells them: the aux-loss-free expert bias (moe/expert_bias.py) and
group-limited routing (moe/router.py); docs/moe.md. Declared beside the other MoE flags (config/moe.py calls
`add_flags` and `check`); the model fields keep the flags' names."""
from __future__ import annotations

import argparse
from typing import Optional

from .errors import require
from .fields import add_section_flags, flag, section

TITLE = "mixture of experts: DeepSeek-V3's router (docs/moe.md)"


@section(TITLE)
class MoERouterBiasConfig:
    """The expert bias and the expert groups of Megatron-Core's top-k router."""
    moe_router_enable_expert_bias: bool = flag(
        "aux-loss-free load balancing: a per-expert bias (state, saved) added to the sigmoid scores to choose the "
        "experts (the weights stay unbiased), moved after each step towards the experts that got fewer tokens "
        "(needs --moe-router-score-function sigmoid)", False, action="store_true")
    moe_router_bias_update_rate: float = flag(
        "the expert bias's step per global batch: rate x sign(mean tokens per expert - the expert's tokens), the "
        "tokens counted over every micro-batch and data-parallel rank", 1e-3)
    moe_router_num_groups: Optional[int] = flag(
        "group-limited routing: the experts in this many equal groups (DeepSeek-V3: the nodes of the EP group)")
    moe_router_group_topk: Optional[int] = flag(
        "group-limited routing: each token's experts come from this many groups, those of the highest sum of their "
        "top-(topk / group-topk) scores")


def add_flags(p: argparse.ArgumentParser) -> None:
    add_section_flags(p, MoERouterBiasConfig)


def check(args) -> None:
    """Megatron-Core's TransformerConfig rules for these flags, one sentence each; with MoE layers only."""
    bias, groups, group_topk = (args.moe_router_enable_expert_bias, args.moe_router_num_groups,
                                args.moe_router_group_topk)
    if args.num_experts is None:
        require(not bias and groups is None and group_topk is None,
                "--moe-router-enable-expert-bias, --moe-router-num-groups and --moe-router-group-topk configure the "
                "router of MoE layers; give --num-experts")
        return
    deepspeed_gating = args.moe_capacity_factor is not None
    require(not bias or (args.moe_router_score_function == "sigmoid" and not deepspeed_gating
                         and args.moe_router_load_balancing_type != "sinkhorn"),
            "--moe-router-enable-expert-bias biases the sigmoid scores of Megatron-Core's top-k router; add "
            "--moe-router-score-function sigmoid (without sinkhorn or DeepSpeed-MoE's capacity gating)")
    require(args.moe_router_bias_update_rate >= 0,
            f"--moe-router-bias-update-rate {args.moe_router_bias_update_rate} must not be negative")
    require(groups is None or group_topk is not None,
            f"--moe-router-num-groups {groups} needs --moe-router-group-topk (the groups each token may use)")
    if group_topk is None:
        return
    experts, topk = args.num_experts, args.moe_router_topk
    require(groups is not None, f"--moe-router-group-topk {group_topk} needs --moe-router-num-groups "
            "(Megatron-Core's rule)")
    require(not deepspeed_gating and args.moe_router_load_balancing_type != "sinkhorn",
            "--moe-router-group-topk limits Megatron-Core's top-k router; it does not apply to sinkhorn or "
            "DeepSpeed-MoE's capacity gating")
    require(groups >= 1 and experts % groups == 0,
            f"--moe-router-num-groups {groups} must divide --num-experts {experts}")
    require(1 <= group_topk <= groups, f"--moe-router-group-topk {group_topk} must lie in 1..--moe-router-num-groups "
            f"{groups}")
    per_group = experts // groups
    require(per_group >= topk // group_topk and group_topk * per_group >= topk,
            f"--moe-router-topk {topk} from --moe-router-group-topk {group_topk} of --moe-router-num-groups {groups} "
            f"groups of {per_group} experts: a group is scored by its top-(topk / group-topk) experts and the chosen "
            "groups must hold topk experts; choose more groups per token or fewer, larger groups")
