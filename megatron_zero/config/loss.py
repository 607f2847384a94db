"""The loss's command-line flags: Megatron's --cross-entropy-loss-fusion and its opposite.

The output layer and the cross-entropy run fused by vocabulary chunks by default (tensor_parallel/output_loss.py): the
same losses in fp32 without the [tokens, vocab] logits, so Megatron's --cross-entropy-loss-fusion asks
for what happens anyway; --no-cross-entropy-loss-fusion computes the whole logits and then the loss
(tensor_parallel/cross_entropy.py), a model converter (model/output_loss_converter.py) sets the stage to. Megatron's
--cross-entropy-fusion-impl native names this PyTorch implementation; its `te` (Transformer Engine's kernel)
is refused by argparse's choices, in one line.
"""
from __future__ import annotations

import argparse

from .fields import add_section_flags, flag, section


@section("loss")
class LossConfig:
    """How the output layer and the loss are computed."""
    cross_entropy_loss_fusion: bool = flag(
        "the output layer and the vocab-parallel cross-entropy fused, by vocabulary chunks (the default: the "
        "[tokens, vocab] logits are never held at once, the losses are the same)", True, action="store_true",
        also=(dict(names=("--no-cross-entropy-loss-fusion",), action="store_false",
                   help="compute the whole [tokens, vocab / TP] logits, then the cross-entropy over them"),))
    cross_entropy_fusion_impl: str = flag("Megatron's choice of fused cross-entropy: native, the PyTorch one here "
                                          "(Transformer Engine's `te` is not used by this build)", "native",
                                          choices=["native"])


def add_flags(p: argparse.ArgumentParser) -> None:
    add_section_flags(p, LossConfig)
