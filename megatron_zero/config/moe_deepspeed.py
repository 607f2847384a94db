"""Megatron-DeepSpeed's MoE flags (declared in moe.py's MoeConfig): turned into the model's MoE fields (model/config.py).

Any of the gating flags (--topk, --expert-interval, --moe-train-capacity-factor,
--moe-eval-capacity-factor, --moe-min-capacity, --disable-moe-token-dropping, --moe-loss-coeff,
--disable-moe-top2-2nd-expert-sampling) chooses DeepSpeed-MoE's capacity gating
(capacity_gating.py) with Megatron-DeepSpeed's defaults for the others: top-1, capacity factors 1.0,
min capacity 4, tokens dropped, coefficient 0.1, an MoE layer in every second block (blocks 1, 3, ...).
Megatron-Core's router flags (--moe-router-*, --moe-aux-loss-coeff, --moe-z-loss-coeff,
--moe-layer-freq) describe the other router and are refused beside them. --moe-expert-parallel-size
is --expert-model-parallel-size under Megatron-DeepSpeed's name (with either router); given both, they
must agree. --create-moe-param-group: expert parameters are in optimizer groups of their own here always.
"""
from __future__ import annotations

from ..model import shape_rules
from .errors import require

GATING = (("--topk", "topk"), ("--expert-interval", "expert_interval"),
          ("--moe-train-capacity-factor", "moe_capacity_factor"),
          ("--moe-eval-capacity-factor", "moe_eval_capacity_factor"), ("--moe-min-capacity", "moe_min_capacity"),
          ("--disable-moe-token-dropping", "moe_drop_tokens"), ("--moe-loss-coeff", "moe_loss_coeff"),
          ("--disable-moe-top2-2nd-expert-sampling", "moe_top2_2nd_expert_sampling"))
CORE_ROUTER = (("--moe-router-topk", "moe_router_topk"), ("--moe-router-pre-softmax", "moe_router_pre_softmax"),
               ("--moe-router-load-balancing-type", "moe_router_load_balancing_type"),
               ("--moe-aux-loss-coeff", "moe_aux_loss_coeff"), ("--moe-z-loss-coeff", "moe_z_loss_coeff"),
               ("--moe-layer-freq", "moe_layer_freq"), ("--moe-router-score-function", "moe_router_score_function"),
               ("--moe-router-topk-scaling-factor", "moe_router_topk_scaling_factor"),
               ("--moe-expert-capacity-factor", "moe_expert_capacity_factor"),
               ("--moe-token-drop-policy", "moe_token_drop_policy"),
               ("--moe-pad-expert-input-to-capacity", "moe_pad_expert_input_to_capacity"))


def apply_deepspeed_moe_flags(args, given: set) -> None:
    """Fill the model's MoE fields from Megatron-DeepSpeed's flags (`given`: destinations set on the command
    line); with none of its gating flags, the capacity fields stay off (Megatron-Core's router)."""
    ep = args.moe_expert_parallel_size
    if ep is not None:
        require("expert_model_parallel_size" not in given or args.expert_model_parallel_size == ep,
                f"--moe-expert-parallel-size {ep} and --expert-model-parallel-size "
                f"{args.expert_model_parallel_size} name one size twice, differently; give one of them")
        args.expert_model_parallel_size = ep
    gating = [flag for flag, dest in GATING if dest in given]
    if not gating:
        return
    require(args.num_experts is not None, f"{gating[0]} configures MoE layers; give --num-experts")
    core = [flag for flag, dest in CORE_ROUTER if dest in given]
    require(not core, f"{gating[0]} (DeepSpeed-MoE's capacity gating) and {core[0] if core else ''} "
            "(Megatron-Core's dropless router) are flags of two different routers; give one family")
    k = 1 if args.topk is None else args.topk
    shape_rules.capacity_gating_topk(k)
    interval = 2 if args.expert_interval is None else args.expert_interval
    require(1 <= interval <= args.num_layers, f"--expert-interval {interval} must lie in 1..--num-layers "
            f"{args.num_layers} (an MoE layer in blocks N-1, 2N-1, ...)")
    args.moe_capacity_factor = 1.0 if args.moe_capacity_factor is None else args.moe_capacity_factor
    if args.moe_eval_capacity_factor is None:
        args.moe_eval_capacity_factor = 1.0
    shape_rules.capacity_factors(args.moe_capacity_factor, args.moe_eval_capacity_factor, args.moe_min_capacity)
    tokens = args.micro_batch_size * args.seq_length // args.context_parallel_size
    require(k != 1 or tokens >= args.moe_min_capacity,
            f"--moe-min-capacity {args.moe_min_capacity} exceeds the {tokens} tokens an MoE layer routes per "
            "micro-batch (--micro-batch-size x --seq-length / --context-parallel-size), which DeepSpeed's top-1 "
            "gating refuses too")
    coeff = 0.1 if args.moe_loss_coeff is None else args.moe_loss_coeff
    require(coeff >= 0, f"--moe-loss-coeff {coeff} must not be negative")
    args.moe_router_topk, args.moe_aux_loss_coeff, args.moe_z_loss_coeff = k, coeff, None
    args.moe_router_pre_softmax, args.moe_router_load_balancing_type = False, "aux_loss"
    args.moe_layer_freq, args.moe_layer_offset = interval, interval - 1
