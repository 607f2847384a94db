"""The interface every ZeRO stage implementation offers ZeroOptimizer (Stage12 for 0/1/2, Stage3).

ZeroOptimizer owns precision, loss scaling, clipping and the AdamW step on flat fp32 partitions;
a stage owns where parameters and gradients live and how they move over the data-parallel group.
This Protocol is what the optimizer (and checkpoint_state.py) may call; a stage must not reach
back into the optimizer. Stage 1/2 additionally offer `group_paddings()` for the checkpoint; every
stage hands its first fp32 partitions over once, as `initial_masters`, which the optimizer takes.
"""
from __future__ import annotations

from typing import Dict, List, Protocol, Sequence, Tuple, runtime_checkable

import torch


@runtime_checkable
class ZeroStage(Protocol):
    dp: int  # ranks the optimizer state is partitioned over (1 for stage 0)
    reduce_dp: int  # ranks gradients are averaged over
    rank: int  # this rank's partition index

    def finish_backward(self) -> None:
        """Reduce what is left of the gradients (idempotent within a step)."""

    def grad_partitions(self) -> List[torch.Tensor]:
        """Per group: this rank's flat gradient partition (reduced, not yet unscaled)."""

    def weight_slices(self) -> List[torch.Tensor]:
        """Per group: the device tensor (model dtype, partition-sized) holding this rank's weights, which
        write_weights publishes from; an offloaded optimizer uploads its stepped masters into it."""

    def write_weights(self, masters: List[torch.Tensor]) -> None:
        """Publish the updated partitions (fp32 masters, or weight_slices() already written) as the
        model's (16-bit) weights."""

    def zero_grad(self) -> None:
        """Drop gradients and reset the reduction state for the next step."""

    def owned_ranges(self, gi: int) -> List[Tuple[torch.nn.Parameter, int, int, int]]:
        """(param, offset in param, offset in partition, numel) of this rank's elements of group gi."""

    def slice_mappings(self, names: Sequence[str]) -> List[Dict[str, Tuple[int, int]]]:
        """Per group: parameter name -> (start, numel) in this rank's partition (DeepSpeed's layout)."""

    def grad_bytes(self) -> int:
        """Bytes of gradient storage held now (for memory reports)."""

    def param_bytes(self) -> int:
        """Bytes of model weights held now (for memory reports)."""

    def remove_hooks(self) -> None:
        """Detach every hook the stage put on the model."""
