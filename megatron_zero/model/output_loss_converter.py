"""How a stage's output layer and loss are computed, as a model converter (model/converters.py).

--cross-entropy-loss-fusion (the default, config/loss.py): the output layer and the vocab-parallel cross-entropy
fused by vocabulary chunks (tensor_parallel/output_loss.py), the [tokens, vocab] logits never held at once;
--no-cross-entropy-loss-fusion: the whole logits, then the cross-entropy over them (tensor_parallel/
cross_entropy.py). The same losses in fp32 either way; the choice is the stage's `fused_output_loss`, which the
multi-token prediction depths' losses follow too. No parameter, buffer or name changes.
"""
from __future__ import annotations

from typing import Optional

import torch

from .converters import ModelConverter


class OutputLossConverter(ModelConverter):
    name = "output_loss"

    def __init__(self, fused: bool = True):
        self.fused = fused

    def convert(self, model: torch.nn.Module) -> Optional[str]:
        """Set the stage's choice; nothing to log (the default, or the flag that asked for the other)."""
        model.fused_output_loss = self.fused
        return None
