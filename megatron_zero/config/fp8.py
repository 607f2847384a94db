"""Megatron-LM's FP8 flags, as torchao's float8 training does them (docs/fp8.md).

--fp8-format turns FP8 on: the blocks' linear layers (QKV, projection, MLP, the MoE experts) run their GEMMs
in FP8.
--fp8-recipe picks the scaling (delayed, Megatron-LM's default, with --fp8-amax-history-len and
--fp8-amax-compute-algo; or torchao's tensorwise / rowwise), --fp8-margin the headroom below the FP8
maximum, --fp8-emulate the emulated GEMMs a device without FP8 tensor cores needs, --fp8-param-gather
ZeRO's weight all-gathers in FP8 (param_gather.py). Megatron-LM's other recipes are refused in
arguments/flag_refusals.py, with the reason.
"""
from __future__ import annotations

import argparse
from typing import Optional

from ..fp8.settings import ALGOS, DEFAULT_RECIPE, FORMATS, RECIPES, Float8Error, import_torchao_float8
from .errors import require
from .fields import add_section_flags, flag, section


@section("FP8 training through torchao's float8 (docs/fp8.md)")
class Fp8Config:
    """FP8 training's format, scaling recipe and options, checked (fp8/settings.py's Float8Settings reads them)."""
    fp8_format: Optional[str] = flag(
        "FP8 GEMMs in the transformer blocks' linear layers (QKV, projection, MLP, MoE experts; not the embedding, the "
        "output layer or the MoE router): e4m3 for every operand, or hybrid (e4m3 forward, e5m2 output gradients, as "
        "Megatron-LM); default: off", choices=FORMATS)
    fp8_recipe: Optional[str] = flag(
        "the scaling: delayed (Transformer Engine's: each tensor's scale from the amax history of earlier "
        "micro-batches; default, as Megatron-LM), tensorwise (torchao's: one scale per tensor from its current amax; "
        "the fastest here), rowwise (one per row, power-of-2 scales), rowwise_with_gw_hp (rowwise, the weight "
        f"gradient's GEMM in the training dtype); default: {DEFAULT_RECIPE}", choices=RECIPES)
    fp8_amax_history_len: Optional[int] = flag("delayed scaling: how many micro-batches' amaxes each scale is taken "
                                               "from (default 1)")
    fp8_amax_compute_algo: Optional[str] = flag("delayed scaling: the amax a scale is computed from, the history's "
                                                "max or its most recent entry (default most_recent)", choices=ALGOS)
    fp8_margin: int = flag("each scale divided by 2^margin: headroom below the FP8 maximum (as Megatron-LM's)", 0)
    fp8_emulate: bool = flag("run the FP8 GEMMs emulated (the FP8 values multiplied in fp32): for a CPU or a GPU "
                             "without FP8 tensor cores (before compute capability 8.9), where FP8 is refused "
                             "otherwise; numerically FP8, not faster", False, action="store_true")
    fp8_param_gather: bool = flag(
        "ZeRO-1/2/3 (--use-distributed-optimizer, --zero-stage) all-gathers the FP8 layers' weights in FP8 (1 byte an "
        "element instead of 2), cast from the fp32 masters once per step with the whole weight's scale; the FP8 GEMMs "
        "use them as they are (tensorwise or delayed scaling)", False, action="store_true")


def add_flags(p: argparse.ArgumentParser) -> None:
    add_section_flags(p, Fp8Config)


def check(args) -> None:
    """Refuse, in one sentence (ArgumentError), what FP8 cannot do with the other flags."""
    if args.fp8_format is None:
        require(args.fp8_margin == 0 and not args.fp8_emulate and args.fp8_recipe is None
                and args.fp8_amax_history_len is None and args.fp8_amax_compute_algo is None
                and not args.fp8_param_gather,
                "--fp8-recipe, --fp8-amax-history-len, --fp8-amax-compute-algo, --fp8-margin, --fp8-emulate and "
                "--fp8-param-gather shape FP8 training, which --fp8-format turns on; give --fp8-format e4m3 or "
                "hybrid, or drop them")
        return
    require(args.fp8_margin >= 0, f"--fp8-margin {args.fp8_margin} must not be negative")
    recipe = args.fp8_recipe or DEFAULT_RECIPE
    require(recipe == "delayed" or (args.fp8_amax_history_len is None and args.fp8_amax_compute_algo is None),
            f"--fp8-amax-history-len and --fp8-amax-compute-algo set delayed scaling's amax history, and "
            f"--fp8-recipe {recipe} scales each tensor by its current amax; drop them or use --fp8-recipe delayed")
    require(args.fp8_amax_history_len is None or args.fp8_amax_history_len >= 1,
            f"--fp8-amax-history-len {args.fp8_amax_history_len} must be at least 1")
    require(recipe != "delayed" or args.recompute_granularity != "full",
            "--fp8-recipe delayed with --recompute-granularity full: the recomputed forward would cast with "
            "scales the first forward's amaxes have already moved, so its activations would differ from the "
            "first forward's; use --fp8-recipe tensorwise, or --recompute-granularity selective")
    _check_param_gather(args, recipe)
    try:
        import_torchao_float8()
    except Float8Error as err:
        require(False, str(err))


def _check_param_gather(args, recipe: str) -> None:
    """--fp8-param-gather: where ZeRO all-gathers weights, with one scale per weight."""
    if not args.fp8_param_gather:
        return
    stage = args.zero_stage
    require(recipe not in ("rowwise", "rowwise_with_gw_hp"),
            f"--fp8-param-gather with --fp8-recipe {recipe}: an FP8 weight is gathered with one scale (torchao's "
            "FP8 all-gather is tensorwise only), and rowwise scales each row; use --fp8-recipe tensorwise or delayed")
    require(stage != 0, "--fp8-param-gather with --zero-stage 0: every rank keeps and steps whole weights, so there "
            "is no weight all-gather to run in FP8; add --use-distributed-optimizer (ZeRO-1) or --zero-stage 2")
    zeropp = args.zero_quantized_weights or args.zero_hpz_partition_size != 1
    require(not zeropp, "--fp8-param-gather with ZeRO++'s --zero-quantized-weights or --zero-hpz-partition-size: "
            "those gather the weights int8-quantized or from a secondary bf16 partition, the FP8 gather moves each "
            "weight's own FP8 bytes; drop one of them")
