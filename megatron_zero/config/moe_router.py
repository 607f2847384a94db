"""Megatron-Core's router flags beyond the dropless top-k: the score function, the top-k scaling factor,
the sequence-level aux loss, Sinkhorn routing and the expert capacity (router.py, sinkhorn.py, token_dropping.py;
docs/moe.md).
Declared here and checked with the other MoE flags (config/moe.py); their model fields keep the flags' names."""
from __future__ import annotations

from .errors import require


def add_core_router_flags(g) -> None:
    g.add_argument("--moe-router-score-function", choices=["softmax", "sigmoid"], default="softmax",
                   help="the router's score: softmax, or sigmoid (top-k of sigmoid(logits), normalised to sum 1)")
    g.add_argument("--moe-router-topk-scaling-factor", type=float, default=None,
                   help="the router weights of the chosen experts times this factor")
    g.add_argument("--moe-router-dtype", choices=["fp32"], default=None,
                   help="the router's GEMM (tokens x router weight) in fp32 under --bf16 / --fp16, as Megatron-Core "
                        "computes it (default: the model dtype; its scores are fp32 either way); fp64 is refused")
    g.add_argument("--moe-permute-fusion", action="store_true",
                   help="no-op: Megatron-Core's fused permute kernel (Transformer Engine); the tokens are permuted by "
                        "index here, the same result")
    g.add_argument("--moe-expert-capacity-factor", type=float, default=None,
                   help="an expert keeps at most ceil(tokens x topk / experts x factor) of a micro-batch's routed "
                        "tokens on each rank, the rest are dropped (default: dropless; negative: dropless)")
    g.add_argument("--moe-token-drop-policy", choices=["probs", "position"], default="probs",
                   help="past capacity drop the lowest router weights (probs) or the latest tokens (position)")
    g.add_argument("--moe-pad-expert-input-to-capacity", action="store_true",
                   help="Megatron-Core pads each expert's input to its capacity with zero-weight rows; the results "
                        "are the same, so here the experts run on their kept rows only")


def check_core_router_flags(args) -> None:
    """One sentence per refusal, as Megatron-Core's TransformerConfig asserts."""
    if args.moe_expert_capacity_factor is not None and args.moe_expert_capacity_factor < 0:
        args.moe_expert_capacity_factor = None  # Megatron-Core: a negative factor means dropless
    capacity = args.moe_expert_capacity_factor
    require(not args.moe_pad_expert_input_to_capacity or capacity is not None,
            "--moe-pad-expert-input-to-capacity pads to the capacity --moe-expert-capacity-factor sets; give it too")
    require(capacity is None or args.moe_capacity_factor is None,
            "--moe-expert-capacity-factor (Megatron-Core's capacity) and DeepSpeed-MoE's capacity gating flags "
            "(--moe-train-capacity-factor, --topk, ...) configure two different routers; give one family")
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
