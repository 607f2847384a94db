"""The multi-token prediction losses in the log, as Megatron-Core's MTPLossLoggingHelper reports them: each
depth's masked mean loss (`mtp_<k> loss`, unscaled), summed over a global batch's micro-batches / M, averaged
over the data-parallel ranks and the iterations of the log interval.

Each iteration adds the values the last stage's forwards recorded (on the device, no host read); at a log
line the stage holding the MTP layers (its ranks only) sums them over its data-parallel group, read once."""
from __future__ import annotations

from typing import Dict

import torch
import torch.distributed as dist


class MTPMetrics:
    def __init__(self, depths: int, device: torch.device):
        self.names = tuple(f"mtp_{k + 1} loss" for k in range(depths))
        self.sums = torch.zeros(depths, dtype=torch.float64, device=device)
        self.iterations = 0

    def iteration(self, mtp, micro_batches: int) -> None:
        """Take what `mtp` (the model's MultiTokenPrediction) recorded in the last global batch's forwards."""
        recorded = mtp.take_loss_sums()
        if recorded is not None:
            self.sums += recorded.double() / micro_batches
        self.iterations += 1

    def report(self, dp_group, dp: int) -> Dict[str, float]:
        """name -> the interval's mean (a collective over `dp_group`: each of its ranks calls it at a log line)."""
        sums = self.sums.clone()
        if dp_group is not None and dist.get_world_size(dp_group) > 1:
            dist.all_reduce(sums, group=dp_group)
        values = (sums / (dp * max(1, self.iterations))).tolist()
        self.sums.zero_()
        self.iterations = 0
        return dict(zip(self.names, values))
