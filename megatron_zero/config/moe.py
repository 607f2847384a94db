"""The mixture-of-experts flags (Megatron-Core's; Megatron-DeepSpeed's in moe_deepspeed.py, the router's
beyond top-k in moe_router.py): their checks and derived values at a layout. The expert groups' rules
(EP within DP x CP, ETP x EP within TP x DP, ETP other than TP without CP) are topology.Layout's
check_expert_parallel; the expert count's is moe/expert_counts.py's."""
from __future__ import annotations

import argparse

from ..moe.expert_counts import check_expert_counts
from ..model.moe_layers import parse_moe_layer_freq, placement
from ..topology import Layout
from .errors import require
from .moe_deepspeed import add_deepspeed_moe_flags, apply_deepspeed_moe_flags
from .moe_router import add_core_router_flags, check_core_router_flags
from . import moe_router_bias


def add_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("mixture of experts (Megatron-Core's flags; docs/moe.md)")
    g.add_argument("--num-experts", type=int, default=None, help="experts per MoE layer (none: a dense model)")
    g.add_argument("--moe-layer-freq", type=parse_moe_layer_freq, default=1,
                   help="every N-th layer (0, N, 2N, ...) is an MoE layer, or one 0 / 1 per layer as Megatron-LM's "
                        "list expression (\"[0]*3+[1]*58\": three dense layers first)")
    g.add_argument("--moe-ffn-hidden-size", type=int, default=None, help="an expert's width (default --ffn-hidden-size)")
    g.add_argument("--moe-router-topk", type=int, default=2,
                   help="experts each token is routed to")
    g.add_argument("--moe-router-pre-softmax", action="store_true",
                   help="softmax over all experts before the top-k (default: top-k of the logits, then softmax)")
    g.add_argument("--moe-router-load-balancing-type", choices=["aux_loss", "none", "seq_aux_loss", "sinkhorn"],
                   default="aux_loss",
                   help="the router's load balancing: aux_loss (the switch loss per micro-batch), seq_aux_loss (per sequence), "
                        "sinkhorn, or none")
    g.add_argument("--moe-aux-loss-coeff", type=float, default=0.0, help="the switch load-balancing loss's weight")
    g.add_argument("--moe-z-loss-coeff", type=float, default=None,
                   help="the router z-loss's weight (default: no z-loss)")
    g.add_argument("--moe-grouped-gemm", action="store_true",
                   help="run the local experts' matmuls as one grouped GEMM each (torch's grouped_mm on CUDA bf16; "
                        "the same parameters and checkpoints)")
    g.add_argument("--moe-token-dispatcher-type", choices=["alltoall", "allgather"], default="alltoall",
                   help="alltoall: variable-size all-to-all over the expert-parallel group; allgather: the tokens "
                        "all-gathered over it, the outputs reduce-scattered back (the same result)")
    g.add_argument("--moe-shared-expert-intermediate-size", type=int, default=None,
                   help="a shared expert MLP of this width that every token goes through, added to the routed "
                        "experts' output (tensor-parallel like the dense MLP, not expert-parallel)")
    g.add_argument("--moe-shared-expert-gate", action="store_true",
                   help="scale the shared expert's output by sigmoid(x g^T), g a [1, h] weight (Qwen2-MoE)")
    g.add_argument("--moe-shared-expert-overlap", action="store_true",
                   help="refused: the shared expert runs after the routed experts, not overlapped with dispatch")
    g.add_argument("--expert-model-parallel-size", type=int, default=1,
                   help="ranks the experts are spread over, carved out of the data-parallel ranks")
    g.add_argument("--expert-tensor-parallel-size", type=int, default=None,
                   help="ranks each expert is tensor-parallel over (default --tensor-model-parallel-size); other "
                        "than TP the expert groups are carved out of TP x DP, as Megatron-Core does (docs/moe.md)")

    add_core_router_flags(g)
    moe_router_bias.add_flags(p)
    add_deepspeed_moe_flags(p)


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
    require(args.moe_ffn_hidden_size >= 1 and args.moe_ffn_hidden_size % etp == 0,
            f"--moe-ffn-hidden-size {args.moe_ffn_hidden_size} is not a positive multiple of "
            f"--expert-tensor-parallel-size {etp}" + (" (default: --tensor-model-parallel-size)" if etp == tp else ""))
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
    require(args.moe_router_load_balancing_type != "seq_aux_loss" and args.moe_expert_capacity_factor is None
            and args.moe_capacity_factor is None,
            "--sequence-parallel with MoE layers routes each TP rank's sequence chunk alone; "
            "--moe-router-load-balancing-type seq_aux_loss and expert capacity (--moe-expert-capacity-factor, "
            "DeepSpeed-MoE's capacity flags) are not available with it")
    require(args.moe_token_dispatcher_type == "alltoall",
            "--moe-token-dispatcher-type allgather runs experts whole on every TP rank's same tokens; with "
            "--sequence-parallel use alltoall")


def _check_shared_expert(args, tp: int) -> None:
    """--moe-shared-expert-intermediate-size and its gate (moe/shared_expert.py)."""
    shared = args.moe_shared_expert_intermediate_size
    require(not args.moe_shared_expert_overlap, "--moe-shared-expert-overlap is not implemented: the shared expert "
            "runs after the routed experts; drop the flag (the result is the same)")
    require(shared is None or args.num_experts is not None,
            f"--moe-shared-expert-intermediate-size {shared} belongs to MoE layers; give --num-experts")
    require(not args.moe_shared_expert_gate or shared is not None,
            "--moe-shared-expert-gate gates the shared expert; give --moe-shared-expert-intermediate-size")
    require(shared is None or (shared >= 1 and shared % tp == 0),
            f"--moe-shared-expert-intermediate-size {shared} is not a positive multiple of "
            f"--tensor-model-parallel-size {tp}")
