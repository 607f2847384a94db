"""The mixture-of-experts flags (Megatron-Core's, its router's beyond top-k, Megatron-DeepSpeed's; the last two
checked in moe_router.py and moe_deepspeed.py): their checks and derived values at a layout. The expert groups' rules
(EP within DP x CP, ETP x EP within TP x DP, ETP other than TP without CP) are topology.Layout's
check_expert_parallel; the expert count's is moe/expert_counts.py's."""
from __future__ import annotations

import argparse
from typing import Optional

from ..moe.expert_counts import check_expert_counts
from ..model import shape_rules
from ..model.config import GPTConfig
from ..model.moe_layers import parse_moe_layer_freq, placement
from ..distributed.topology import Layout
from .errors import require
from .fields import add_section_flags, derived, flag, section
from .moe_deepspeed import apply_deepspeed_moe_flags
from .moe_router import check_core_router_flags
from . import moe_router_bias


DEEPSPEED = "mixture of experts, Megatron-DeepSpeed's flags (DeepSpeed-MoE's capacity gating; docs/moe.md)"


@section("mixture of experts (Megatron-Core's flags; docs/moe.md)")
class MoeConfig:
    """The MoE flags: Megatron-Core's, its router's beyond top-k (checked in moe_router.py) and Megatron-DeepSpeed's
    (moe_deepspeed.py, which turns them into the same fields), checked."""
    num_experts: Optional[int] = flag("experts per MoE layer (none: a dense model)")
    moe_layer_freq: object = flag("every N-th layer (0, N, 2N, ...) is an MoE layer, or one 0 / 1 per layer as "
                                  "Megatron-LM's list expression (\"[0]*3+[1]*58\": three dense layers first)",
                                  GPTConfig.moe_layer_freq,
                                  type=parse_moe_layer_freq)
    moe_ffn_hidden_size: Optional[int] = flag("an expert's width (default --ffn-hidden-size)")
    moe_router_topk: int = flag("experts each token is routed to", GPTConfig.moe_router_topk)
    moe_router_pre_softmax: bool = flag("softmax over all experts before the top-k (default: top-k of the logits, "
                                        "then softmax)", GPTConfig.moe_router_pre_softmax, action="store_true")
    moe_router_load_balancing_type: str = flag(
        "the router's load balancing: aux_loss (the switch loss per micro-batch), seq_aux_loss (per sequence), "
        "sinkhorn, or none",
        GPTConfig.moe_router_load_balancing_type, choices=["aux_loss", "none", "seq_aux_loss", "sinkhorn"])
    moe_aux_loss_coeff: float = flag("the switch load-balancing loss's weight", GPTConfig.moe_aux_loss_coeff)
    moe_z_loss_coeff: Optional[float] = flag("the router z-loss's weight (default: no z-loss)")
    moe_grouped_gemm: bool = flag("run the local experts' matmuls as one grouped GEMM each (torch's grouped_mm on "
                                  "CUDA bf16; the same parameters and checkpoints)",
                                  GPTConfig.moe_grouped_gemm, action="store_true")
    moe_token_dispatcher_type: str = flag(
        "alltoall: variable-size all-to-all over the expert-parallel group; allgather: the tokens all-gathered over "
        "it, the outputs reduce-scattered back (the same result)",
        GPTConfig.moe_token_dispatcher_type, choices=["alltoall", "allgather"])
    moe_shared_expert_intermediate_size: Optional[int] = flag(
        "a shared expert MLP of this width that every token goes through, added to the routed experts' output "
        "(tensor-parallel like the dense MLP, not expert-parallel)")
    moe_shared_expert_gate: bool = flag("scale the shared expert's output by sigmoid(x g^T), g a [1, h] weight "
                                        "(Qwen2-MoE)", GPTConfig.moe_shared_expert_gate, action="store_true")
    moe_shared_expert_overlap: bool = flag("no-op: the shared expert runs after the routed experts here (Megatron-Core's "
                                           "overlap with the dispatch gives the same result); needs a shared expert",
                                           False, action="store_true")
    expert_model_parallel_size: int = flag("ranks the experts are spread over, carved out of the data-parallel ranks",
                                           1)
    expert_tensor_parallel_size: Optional[int] = flag(
        "ranks each expert is tensor-parallel over (default --tensor-model-parallel-size); other than TP the expert "
        "groups are carved out of TP x DP, as Megatron-Core does (docs/moe.md)")
    # Megatron-Core's router beyond the dropless top-k (moe_router.py checks them)
    moe_router_score_function: str = flag("the router's score: softmax, or sigmoid (top-k of sigmoid(logits), "
                                          "normalised to sum 1)",
                                          GPTConfig.moe_router_score_function, choices=["softmax", "sigmoid"])
    moe_router_topk_scaling_factor: Optional[float] = flag("the router weights of the chosen experts times this "
                                                           "factor")
    moe_router_dtype: Optional[str] = flag(
        "the router's GEMM (tokens x router weight) in fp32 under --bf16 / --fp16, as Megatron-Core computes it "
        "(default: the model dtype; its scores are fp32 either way); fp64 is refused", choices=["fp32"])
    moe_permute_fusion: bool = flag("no-op: Megatron-Core's fused permute kernel (Transformer Engine); the tokens "
                                    "are permuted by index here, the same result", False, action="store_true")
    moe_expert_capacity_factor: Optional[float] = flag(
        "an expert keeps at most ceil(tokens x topk / experts x factor) of a micro-batch's routed tokens on each "
        "rank, the rest are dropped (default: dropless; negative: dropless)")
    moe_token_drop_policy: str = flag("past capacity drop the lowest router weights (probs) or the latest tokens "
                                      "(position)", GPTConfig.moe_token_drop_policy, choices=["probs", "position"])
    moe_pad_expert_input_to_capacity: bool = flag(
        "Megatron-Core pads each expert's input to its capacity with zero-weight rows; the results are the same, so "
        "here the experts run on their kept rows only", GPTConfig.moe_pad_expert_input_to_capacity, action="store_true")
    # Megatron-DeepSpeed's (moe_deepspeed.py turns them into the fields above)
    moe_expert_parallel_size: Optional[int] = flag("Megatron-DeepSpeed's name for --expert-model-parallel-size",
                                                   group=DEEPSPEED)
    topk: Optional[int] = flag("experts per token of the capacity gating: 1 or 2 (default 1)", group=DEEPSPEED)
    expert_interval: Optional[int] = flag("an MoE layer in every N-th block, blocks N-1, 2N-1, ... (default 2)",
                                          group=DEEPSPEED)
    moe_capacity_factor: Optional[float] = flag(
        "an expert takes at most max(ceil(tokens / experts x factor x k), --moe-min-capacity) of a micro-batch's "
        "tokens in training; the rest are dropped (default 1.0)", group=DEEPSPEED,
        names=("--moe-train-capacity-factor",))
    moe_eval_capacity_factor: Optional[float] = flag("the same in evaluation (default 1.0)", group=DEEPSPEED)
    moe_min_capacity: int = flag("the least capacity per expert",
                                 GPTConfig.moe_min_capacity, group=DEEPSPEED)  # Megatron-DeepSpeed's
    moe_drop_tokens: bool = flag("no capacity limit: every token reaches its experts",
                                 GPTConfig.moe_drop_tokens, group=DEEPSPEED,
                                 names=("--disable-moe-token-dropping",), action="store_false")
    moe_loss_coeff: Optional[float] = flag("the weight of DeepSpeed's load-balancing loss E sum_e(me_e ce_e) in the "
                                           "loss (default 0.1)", group=DEEPSPEED)
    moe_top2_2nd_expert_sampling: bool = flag("top-2: the second expert by argmax instead of Gumbel sampling",
                                              GPTConfig.moe_top2_2nd_expert_sampling,
                                              group=DEEPSPEED, names=("--disable-moe-top2-2nd-expert-sampling",),
                                              action="store_false")
    create_moe_param_group: bool = flag(
        "expert parameters in optimizer groups of their own: always so here (ZeRO partitions and reduces them over "
        "the expert-data-parallel group), with or without this flag", False, group=DEEPSPEED, action="store_true")
    moe_layer_offset: int = derived("the first MoE layer's index (Megatron-DeepSpeed's --expert-interval N: N-1; "
                                    "0 otherwise)")


def add_flags(p: argparse.ArgumentParser) -> None:
    add_section_flags(p, MoeConfig)
    moe_router_bias.add_flags(p)
    p.set_defaults(moe_layer_offset=0)


def check(args, layout: Layout, given: set) -> None:
    """The MoE flags this trainer implements, and the layouts it runs them at (docs/moe.md); fills
    --expert-tensor-parallel-size (default TP) and --moe-ffn-hidden-size (default --ffn-hidden-size).
    `given`: the destinations set on the command line."""
    apply_deepspeed_moe_flags(args, given)
    tp = layout.tp
    ep, experts = args.expert_model_parallel_size, args.num_experts
    require(ep >= 1, f"--expert-model-parallel-size {ep} must be at least 1")
    _check_shared_expert(args, tp)
    moe_router_bias.check(args)
    if args.expert_tensor_parallel_size is None:
        args.expert_tensor_parallel_size = tp
    etp = args.expert_tensor_parallel_size
    if etp != tp:
        _check_expert_tensor_parallel(args, tp)
    if experts is None:
        require(ep == 1, f"--expert-model-parallel-size {ep} needs MoE layers; give --num-experts")
        require(args.moe_expert_capacity_factor is None, "--moe-expert-capacity-factor configures MoE layers; "
                "give --num-experts")
        return
    check_expert_counts(experts, args.moe_router_topk, ep)
    layout.check_expert_parallel(ep, etp)
    if isinstance(args.moe_layer_freq, tuple):
        try:
            args.moe_layer_freq, args.moe_layer_offset = placement(args.moe_layer_freq, args.num_layers)
        except ValueError as e:
            require(False, str(e))
    require(isinstance(args.moe_layer_freq, tuple) or args.moe_layer_freq >= 1,
            f"--moe-layer-freq {args.moe_layer_freq} must be at least 1")
    if args.moe_ffn_hidden_size is None:
        args.moe_ffn_hidden_size = args.ffn_hidden_size
    shape_rules.expert_ffn_split(args.moe_ffn_hidden_size, etp, etp == tp)
    check_core_router_flags(args)
    require(args.moe_aux_loss_coeff >= 0 and (args.moe_z_loss_coeff or 0) >= 0,
            "--moe-aux-loss-coeff and --moe-z-loss-coeff must not be negative")
    _check_sequence_parallel(args, tp)
    if ep > 1:
        require(not (args.zero_quantized_weights or args.zero_quantized_gradients or args.zero_hpz_partition_size > 1),
                f"--expert-model-parallel-size {ep} runs without ZeRO++ (--zero-quantized-weights, "
                "--zero-quantized-gradients, --zero-hpz-partition-size); drop those flags")


def _check_expert_tensor_parallel(args, tp: int) -> None:
    """--expert-tensor-parallel-size other than TP: what it composes with (its layout: check_expert_parallel)."""
    etp = args.expert_tensor_parallel_size
    require(etp >= 1, f"--expert-tensor-parallel-size {etp} must be at least 1")
    require(args.num_experts is not None, f"--expert-tensor-parallel-size {etp} splits the experts of MoE layers; "
            "give --num-experts")
    require(tp == 1 or args.sequence_parallel,
            f"--expert-tensor-parallel-size {etp} other than --tensor-model-parallel-size {tp} needs "
            "--sequence-parallel: each TP rank then routes its own tokens (Megatron-Core's rule)")
    require(args.zero_stage in (0, 1, 2) and args.offload == "none" and not args.zero_nvme_offload_path,
            f"--expert-tensor-parallel-size {etp} other than TP runs with --zero-stage 0, 1 or 2 and without "
            "optimizer offload")
    require(not args.universal_checkpoint,
            f"--expert-tensor-parallel-size {etp} other than --tensor-model-parallel-size {tp} with "
            "--universal-checkpoint is not available: a universal checkpoint's experts load split by TP")
    require(args.moe_token_dispatcher_type == "alltoall", f"--moe-token-dispatcher-type allgather with "
            f"--expert-tensor-parallel-size {etp} other than TP is not available; use alltoall")


def _check_sequence_parallel(args, tp: int) -> None:
    """--sequence-parallel with MoE layers: each TP rank routes its own sequence chunk (moe/layer.py)."""
    if not (args.sequence_parallel and tp > 1):
        return
    require(args.moe_expert_capacity_factor is None and args.moe_capacity_factor is None,
            "--sequence-parallel with MoE layers routes each TP rank's sequence chunk alone; expert capacity "
            "(--moe-expert-capacity-factor, DeepSpeed-MoE's capacity flags) is not available with it")
    require(args.moe_token_dispatcher_type == "alltoall",
            "--moe-token-dispatcher-type allgather runs experts whole on every TP rank's same tokens; with "
            "--sequence-parallel use alltoall")


def _check_shared_expert(args, tp: int) -> None:
    """--moe-shared-expert-intermediate-size and its gate (moe/shared_expert.py)."""
    shared = args.moe_shared_expert_intermediate_size
    require(not args.moe_shared_expert_overlap or shared is not None, "--moe-shared-expert-overlap overlaps a shared "
            "expert with the dispatch; give --moe-shared-expert-intermediate-size or drop the flag")
    require(shared is None or args.num_experts is not None,
            f"--moe-shared-expert-intermediate-size {shared} belongs to MoE layers; give --num-experts")
    shape_rules.shared_expert_gate(args.moe_shared_expert_gate, shared)
    shape_rules.shared_expert_split(shared, tp)
