"""The loss's command-line flags: Megatron's --cross-entropy-loss-fusion and its opposite.

The output layer and the cross-entropy run fused by vocabulary chunks by default (output_loss.py): the
same losses in fp32 without the [tokens, vocab] logits, so Megatron's --cross-entropy-loss-fusion asks
for what happens anyway; --no-cross-entropy-loss-fusion computes the whole logits and then the loss
(cross_entropy.py), the switch ops/fusion_flags.py holds as `cross_entropy_loss_fusion`. Megatron's
--cross-entropy-fusion-impl native names this PyTorch implementation; its `te` (Transformer Engine's kernel)
is refused by argparse's choices, in one line.
"""
from __future__ import annotations

import argparse


def add_loss_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("loss")
    g.add_argument("--cross-entropy-loss-fusion", dest="cross_entropy_loss_fusion", action="store_true",
                   default=True,
                   help="the output layer and the vocab-parallel cross-entropy fused, by vocabulary chunks "
                        "(the default: the [tokens, vocab] logits are never held at once, the losses are the same)")
    g.add_argument("--no-cross-entropy-loss-fusion", dest="cross_entropy_loss_fusion", action="store_false",
                   help="compute the whole [tokens, vocab / TP] logits, then the cross-entropy over them")
    g.add_argument("--cross-entropy-fusion-impl", choices=["native"], default="native",
                   help="Megatron's choice of fused cross-entropy: native, the PyTorch one here (Transformer "
                        "Engine's `te` is not used by this build)")
