"""The multi-token prediction losses in the log, as Megatron-Core's MTPLossLoggingHelper reports them: each
depth's masked mean loss (`mtp_<k> loss`, unscaled), summed over a global batch's micro-batches / M, averaged
over the data-parallel ranks and the iterations of the log interval.

Each iteration adds the values the last stage's forwards recorded (on the device, no host read); at a log
line the stage holding the MTP layers (its ranks only) sums them over its data-parallel group, read once."""
from __future__ import annotations

from typing import Callable, Dict

import torch
import torch.distributed as dist


class MTPMetrics:
    def __init__(self, depths: int, device: torch.device, dp_group, dp: int, log_interval: int, train_iters: int):
        self.names = tuple(f"mtp_{k + 1} loss" for k in range(depths))
        self.sums = torch.zeros(depths, dtype=torch.float64, device=device)
        self.iterations = 0
        self.dp_group, self.dp, self.log_interval, self.train_iters = dp_group, dp, log_interval, train_iters

    @classmethod
    def of(cls, model, state, log_interval: int, train_iters: int, device: torch.device):
        """The metrics of the stage holding `model`'s MTP layers; None on a stage without them."""
        if model.mtp is None:
            return None
        return cls(len(model.mtp), device, state.dp_group, state.data_parallel_size, log_interval, train_iters)

    def after_iteration(self, mtp, micro_batches: int, progress, scalars, log_line: Callable[[str], None]) -> None:
        """Take what `mtp` (the model's MultiTokenPrediction) recorded in the last global batch's forwards; at a
        log line (a collective over the data-parallel group) write each depth's mean as a scalar and one line."""
        recorded = mtp.take_loss_sums()
        if recorded is not None:
            self.sums += recorded.double() / micro_batches
        self.iterations += 1
        it = progress.iteration
        if it % self.log_interval != 0 and it != self.train_iters:
            return
        values = self.report()
        for name, value in values.items():
            scalars.scalar(name, value, it, progress.consumed_train_samples)
        log_line(f" iteration {it:8d} | " + " | ".join(f"{k}: {v:.6E}" for k, v in values.items()) + " |")

    def report(self) -> Dict[str, float]:
        """name -> the interval's mean (a collective over the data-parallel group)."""
        sums = self.sums.clone()
        if self.dp_group is not None and dist.get_world_size(self.dp_group) > 1:
            dist.all_reduce(sums, group=self.dp_group)
        values = (sums / (self.dp * max(1, self.iterations))).tolist()
        self.sums.zero_()
        self.iterations = 0
        return dict(zip(self.names, values))
