"""`--optimizer` and Muon's and QK-clip's flags as Megatron-LM spells them (docs/optimizers.md): their checks, and
the MuonSettings (optimizer/muon.py) a run's optimizer is built with."""
from __future__ import annotations

import argparse

from .errors import require
from .fields import add_section_flags, flag, flag_fields, flag_spelling, section

MUON_OPTIMIZERS = ("muon", "dist_muon")
MUON = "Muon and QK-clip (docs/optimizers.md)"


@section(MUON)
class MuonConfig:
    """Which optimizer steps the blocks' matrices, Muon's settings, and QK-clip's."""
    optimizer: str = flag("adam and adamw: AdamW with decoupled weight decay everywhere (Megatron's Adam is AdamW); "
                          "muon and dist_muon: Muon on the blocks' 2-D weight matrices, AdamW on the rest, the state "
                          "sharded at --zero-stage (dist_muon: 1 or more, as Megatron-LM's layer-wise distributed Muon)",
                          "adamw", choices=["adam", "adamw", *MUON_OPTIMIZERS])
    muon_momentum: float = flag("Muon's momentum (the EMA of the gradient it orthogonalizes)", 0.95)
    muon_split_qkv: bool = flag("orthogonalize the fused QKV weight as one matrix, not as Q, K and V", True,
                                names=("--muon-no-split-qkv",), action="store_false")
    muon_use_nesterov: bool = flag("Nesterov momentum: orthogonalize lerp(grad, momentum, --muon-momentum)", False,
                                   action="store_true")
    muon_scale_mode: str = flag("the update's scale: spectral sqrt(max(rows, cols)), unit_rms_norm sqrt(rows/cols), "
                                "shape_scaling sqrt(max(1, rows/cols))", "spectral",
                                choices=["spectral", "unit_rms_norm", "shape_scaling"])
    muon_fp32_matmul_prec: str = flag("Newton-Schulz precision: medium (bf16), high (TF32 where the device has it), "
                                      "highest (fp32)", "medium", choices=["medium", "high", "highest"])
    muon_num_ns_steps: int = flag("Newton-Schulz iterations (Megatron-Core's quintic coefficients, cycled)", 5)
    muon_tp_mode: str = flag("tensor-parallel matrices: blockwise (each shard its own matrix), duplicated (gathered "
                             "whole on every TP rank), distributed (Gram matrices summed over TP)", "blockwise",
                             choices=["blockwise", "duplicated", "distributed"])
    muon_extra_scale_factor: float = flag("a further factor on Muon's update (0.2 with spectral: AdamW's update RMS)",
                                          1.0)
    qk_clip: bool = flag("QK-clip (Kimi K2's MuonClip): after a step whose max attention logit of a head passes "
                         "--qk-clip-threshold, scale that head's q and k weights down", False, action="store_true")
    qk_clip_alpha: float = flag("QK-clip's split of the scale eta: q by eta^alpha, k by eta^(1 - alpha)", 0.5)
    qk_clip_threshold: float = flag("QK-clip's max attention logit; eta = min(threshold / max logit, 1)", 100.0)
    log_max_attention_logit: bool = flag("log the max attention logit over the model (on with --qk-clip)", False,
                                         action="store_true")

    @property
    def is_muon(self) -> bool:
        return self.optimizer in MUON_OPTIMIZERS


def add_flags(p: argparse.ArgumentParser) -> None:
    add_section_flags(p, MuonConfig)


def check(args, given: set) -> None:
    """Muon's flags with Muon only, their values, and what Muon does not run with."""
    muon = args.optimizer in MUON_OPTIMIZERS
    stray = [flag_spelling(MuonConfig, n) for n in flag_fields(MuonConfig) if n.startswith("muon_") and n in given]
    require(muon or not stray, f"{', '.join(stray)} set Muon, which --optimizer {args.optimizer} does not use; add "
            "--optimizer muon (or dist_muon) or drop them")
    require(0 <= args.muon_momentum < 1, f"--muon-momentum {args.muon_momentum} must lie in [0, 1)")
    require(args.muon_num_ns_steps >= 1, f"--muon-num-ns-steps {args.muon_num_ns_steps} must be at least 1")
    require(args.muon_extra_scale_factor > 0,
            f"--muon-extra-scale-factor {args.muon_extra_scale_factor} must be positive")
    require(0 <= args.qk_clip_alpha <= 1, f"--qk-clip-alpha {args.qk_clip_alpha} must lie in [0, 1]")
    require(args.qk_clip_threshold > 0, f"--qk-clip-threshold {args.qk_clip_threshold} must be positive")
    if args.qk_clip:
        args.log_max_attention_logit = True
    groups, tp = args.num_query_groups or args.num_attention_heads, args.tensor_model_parallel_size
    require(not args.log_max_attention_logit or groups >= tp,
            f"--qk-clip and --log-max-attention-logit read each query group's heads on one TP rank; "
            f"--num-query-groups {groups} is fewer than --tensor-model-parallel-size {tp}")
    if not muon:
        return
    require(args.optimizer != "dist_muon" or args.zero_stage >= 1,
            f"--optimizer dist_muon shards Muon's state over data-parallel ranks, which --zero-stage {args.zero_stage} "
            "does not; use --zero-stage 1, 2 or 3, or --optimizer muon")
    require(args.offload == "none", "Muon orthogonalizes its matrices on the device; it does not run with "
            "--cpu-optimizer or --zero-nvme-offload-path (drop them, or use --optimizer adamw)")
    require(not args.muon_split_qkv or groups >= tp,
            f"Muon splits each TP rank's QKV rows into its query groups' Q, K and V, and --num-query-groups {groups} "
            f"below --tensor-model-parallel-size {tp} leaves no whole group on a rank; add --muon-no-split-qkv")
