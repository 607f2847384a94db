"""The MoE losses in the log, as Megatron-Core's track_moe_metrics reports them: each loss divided by its
coefficient, summed over micro-batches / M (per global batch), averaged over the model's MoE layers,
the data-parallel ranks and the iterations of the log interval (`load_balancing_loss`, `z_loss`; with the
sequence-level aux loss `seq_load_balancing_loss` in place of the first, Megatron-Core's name).

Each iteration adds this rank's values on the device (no host read, no collective); at a log line
every rank sums them over the pipeline (layers live on different stages) and data-parallel groups in
one all-reduce, read once."""
from __future__ import annotations

from typing import Dict, Optional

import torch
import torch.distributed as dist

from .router import aux_losses, reset_aux_losses

NAMES = ("load_balancing_loss", "z_loss")
SEQ_NAMES = ("seq_load_balancing_loss", "z_loss")  # --moe-router-load-balancing-type seq_aux_loss


def logged_names(config) -> tuple:
    """The losses the flags have the router compute, so the log shows only those: the balance loss with a
    positive --moe-aux-loss-coeff (DeepSpeed-MoE's capacity gating's l_aux, or Megatron-Core's aux_loss /
    seq_aux_loss; sinkhorn and none have none), the z-loss with --moe-z-loss-coeff (Megatron-Core's router).
    A loss not computed is left out rather than logged as 0, which would read as a value."""
    names = []
    if config.moe_aux_loss_coeff and config.moe_aux_loss_coeff > 0:
        if config.moe_capacity_factor is not None or config.moe_router_load_balancing_type == "aux_loss":
            names.append("load_balancing_loss")
        elif config.moe_router_load_balancing_type == "seq_aux_loss":
            names.append("seq_load_balancing_loss")
    if config.moe_z_loss_coeff and config.moe_capacity_factor is None:
        names.append("z_loss")
    return tuple(names)


class MoEMetrics:
    def __init__(self, num_moe_layers: int, device: torch.device, names=NAMES):
        self.num_moe_layers, self.device, self.names = num_moe_layers, device, tuple(names)
        self.sums = torch.zeros(len(self.names), dtype=torch.float64, device=device)
        self.iterations = 0

    def iteration(self, micro_batches: int) -> None:
        """Take the values the last global batch's forwards recorded (and reset them)."""
        tracked = aux_losses()
        for i, name in enumerate(self.names):
            if name in tracked:
                self.sums[i] += tracked[name].double() / micro_batches
        reset_aux_losses()
        self.iterations += 1

    def report(self, pp_group, dp_group, dp: int, sp_group=None) -> Optional[Dict[str, float]]:
        """name -> the interval's mean (a collective over PP and DP: every rank calls it at each log line).
        `dp_group` is the gradient-reduction group (DP x CP); `dp` the data replicas: a CP rank's values are
        its share of its sequences' losses (router.py), which the group's sum completes; `sp_group`: the TP
        group under sequence parallelism, whose ranks likewise hold shares of their micro-batches' losses."""
        sums = self.sums.clone()
        for group in (pp_group, dp_group, sp_group):
            if group is not None and dist.get_world_size(group) > 1:
                dist.all_reduce(sums, group=group)
        values = (sums / (self.num_moe_layers * dp * max(1, self.iterations))).tolist()
        self.sums.zero_()
        self.iterations = 0
        return dict(zip(self.names, values))
