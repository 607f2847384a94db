"""Megatron-Core's router flags beyond the dropless top-k: the score function, the top-k scaling factor,
the sequence-level aux loss, Sinkhorn routing and the expert capacity (router.py, sinkhorn.py, token_dropping.py;
docs/moe.md).
Declared in config/moe.py's MoeConfig, checked here with the other MoE flags; their model fields keep the
flags' names."""
from __future__ import annotations

from ..model import shape_rules
from .errors import require


def check_core_router_flags(args) -> None:
    """One sentence per refusal, as Megatron-Core's TransformerConfig asserts."""
    if args.moe_expert_capacity_factor is not None and args.moe_expert_capacity_factor < 0:
        args.moe_expert_capacity_factor = None  # Megatron-Core: a negative factor means dropless
    capacity = args.moe_expert_capacity_factor
    shape_rules.capacity_padding(args.moe_pad_expert_input_to_capacity, capacity)
    shape_rules.one_capacity(capacity, args.moe_capacity_factor)
    cp = args.context_parallel_size
    require(cp == 1 or (capacity is None and args.moe_capacity_factor is None),
            f"--context-parallel-size {cp} with an expert capacity ("
            f"{'--moe-expert-capacity-factor' if capacity is not None else '--moe-train-capacity-factor'}) is not "
            "implemented: the capacity counts each sequence's tokens, which context parallelism splits over ranks; "
            "train dropless or without context parallelism")
    if args.moe_router_load_balancing_type == "sinkhorn":  # Megatron-Core asserts the first, ignores the others
        for given, flag in ((args.moe_aux_loss_coeff > 0, f"--moe-aux-loss-coeff {args.moe_aux_loss_coeff}"),
                            (args.moe_router_score_function != "softmax", "--moe-router-score-function sigmoid"),
                            (args.moe_router_pre_softmax, "--moe-router-pre-softmax"),
                            (args.moe_router_topk_scaling_factor is not None, "--moe-router-topk-scaling-factor")):
            require(not given, f"{flag} does not apply to --moe-router-load-balancing-type sinkhorn (its weights are "
                    "sigmoid or softmax of the logits at the Sinkhorn-balanced top-k, with no aux loss); drop it")
