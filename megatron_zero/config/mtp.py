"""Multi-token prediction's flags, as Megatron-LM spells them (model/multi_token_prediction.py; docs/models.md):
their declarations and the layouts the MTP layers run at."""
from __future__ import annotations

import argparse
from typing import Optional

from .errors import require
from .fields import add_section_flags, flag, section

MTP = "multi-token prediction (DeepSeek-V3's MTP, docs/models.md)"


@section(MTP)
class MTPConfig:
    """How many further tokens each position predicts, and their losses' weight."""
    mtp_num_layers: Optional[int] = flag(
        "MTP depths on the last pipeline stage: depth k predicts the token k + 1 places ahead from depth k - 1's "
        "output and the embedding of the token k places ahead (Megatron-Core's MultiTokenPredictionBlock)", None)
    mtp_loss_scaling_factor: float = flag(
        "the MTP depths' mean loss times this joins the language-model loss's gradient (the LM loss logged "
        "stays its own; each depth's loss is logged as mtp_<k> loss)", 0.1)


def add_flags(p: argparse.ArgumentParser) -> None:
    add_section_flags(p, MTPConfig)


def check(args) -> None:
    """The depths' count, and the layouts the MTP layers do not run at, in one sentence each (each depth's block
    is built as the last transformer layer, dense or MoE)."""
    n = args.mtp_num_layers
    if not n:
        args.mtp_num_layers = None
        return
    require(n >= 1, f"--mtp-num-layers {n} must be at least 1")
    require(args.mtp_loss_scaling_factor >= 0,
            f"--mtp-loss-scaling-factor {args.mtp_loss_scaling_factor} must not be negative")
    cp = args.context_parallel_size
    require(cp == 1, f"--mtp-num-layers with --context-parallel-size {cp} is not implemented here: its shifted "
            "tokens and labels cross the context-parallel ranks' chunks; train MTP without context parallelism")
