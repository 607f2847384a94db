"""Megatron-LM's FP8 flags, as torchao's float8 training does them (docs/fp8.md).

--fp8-format turns FP8 on: the blocks' linear layers (QKV, projection, MLP) run their GEMMs in FP8.
--fp8-recipe picks torchao's scaling, --fp8-margin the headroom below the FP8 maximum, --fp8-emulate the
emulated GEMMs a device without FP8 tensor cores needs. Megatron-LM's delayed-scaling flags
(--fp8-amax-history-len, --fp8-amax-compute-algo), its other recipes and --fp8-param-gather are refused
in flag_refusals.py, with the reason and the closest recipe torchao has.
"""
from __future__ import annotations

import argparse

from ..config.errors import require
from .settings import FORMATS, RECIPES, Float8Error, import_torchao_float8


def add_fp8_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("FP8 training through torchao's float8 (docs/fp8.md)")
    g.add_argument("--fp8-format", choices=FORMATS, default=None,
                   help="FP8 GEMMs in the transformer blocks' linear layers (QKV, projection, MLP; not the embedding "
                        "or output layer): e4m3 for every operand, or hybrid (e4m3 forward, e5m2 output gradients, "
                        "as Megatron-LM); default: off")
    g.add_argument("--fp8-recipe", choices=RECIPES, default="tensorwise",
                   help="torchao's scaling: tensorwise (one scale per tensor, the fastest), rowwise (one per row, "
                        "power-of-2 scales), rowwise_with_gw_hp (rowwise, the weight gradient's GEMM in the "
                        "training dtype); tensorwise is the closest to Megatron-LM's delayed scaling")
    g.add_argument("--fp8-margin", type=int, default=0,
                   help="each scale divided by 2^margin: headroom below the FP8 maximum (as Megatron-LM's)")
    g.add_argument("--fp8-emulate", action="store_true",
                   help="run the FP8 GEMMs emulated (the FP8 values multiplied in fp32): for a CPU or a GPU "
                        "without FP8 tensor cores (before compute capability 8.9), where FP8 is refused "
                        "otherwise; numerically FP8, not faster")


def check_fp8_flags(args) -> None:
    """Refuse, in one sentence (ArgumentError), what FP8 cannot do with the other flags."""
    if args.fp8_format is None:
        require(args.fp8_margin == 0 and not args.fp8_emulate and args.fp8_recipe == "tensorwise",
                "--fp8-recipe, --fp8-margin and --fp8-emulate shape FP8 training, which --fp8-format turns on; "
                "give --fp8-format e4m3 or hybrid, or drop them")
        return
    require(args.fp8_margin >= 0, f"--fp8-margin {args.fp8_margin} must not be negative")
    require(args.num_experts is None,
            "--fp8-format with --num-experts: FP8 experts are not built here (the grouped-GEMM and expert-TP "
            "paths multiply the experts' weights outside the linear layers the FP8 converter replaces); train "
            "the MoE model in --bf16")
    try:
        import_torchao_float8()
    except Float8Error as err:
        require(False, str(err))
