"""The aux-loss-free expert bias (DeepSeek-V3; Megatron-Core's --moe-router-enable-expert-bias): its state and
its update.

    state     each MoE layer's router holds `expert_bias` [E] (fp32, a persistent buffer of the layer, whole on
              every rank: not an expert-parallel slice; `mlp.deepspeed_moe.gate.expert_bias`, so checkpoints save
              and reshape it with the layer) and `tokens_per_expert` [E] (fp32, not saved): the tokens this rank
              routed to each expert in the training forwards since the last update (`record`: not in
              evaluation, not again in full recompute's second forward)
    update    once per global batch, after the optimizer step (`ExpertBiasUpdate.step`): every layer's counts
              stacked, summed over the stage's data-parallel x CP group (and the TP group where each TP rank
              routes its own tokens: sequence parallelism), then  b += rate * sign(mean_e(n) - n_e)
              (Megatron-Core's get_updated_expert_bias), and the counts zeroed

The sum covers every micro-batch of every data-parallel (and expert-parallel, which is carved out of it) rank
of the stage, so each layout counts the same tokens and makes the same update, bit for bit. Megatron-Core sums
over TP even where the TP ranks route the same tokens; the counts are then TP times larger, the signs the same.
One all-reduce per group of device tensors; nothing is read on the host. The router's use of the bias:
router.py's scores_and_choice.
"""
from __future__ import annotations

from typing import List

import torch
import torch.distributed as dist

from ..distributed import shm_comm
from ..tensor_parallel.random import is_recomputing


def add_expert_bias(router: torch.nn.Module, num_experts: int) -> None:
    """Give `router` its `expert_bias` (saved) and `tokens_per_expert` (not saved) buffers, zeros."""
    router.register_buffer("expert_bias", torch.zeros(num_experts, dtype=torch.float32))
    router.register_buffer("tokens_per_expert", torch.zeros(num_experts, dtype=torch.float32), persistent=False)


def record(router: torch.nn.Module, counts: torch.Tensor) -> None:
    """Add a training forward's tokens per expert [E] (of the experts kept, after any capacity drop)."""
    if router.training and torch.is_grad_enabled() and not is_recomputing():
        router.tokens_per_expert += counts.to(router.tokens_per_expert.dtype)


def updated_bias(tokens_per_expert: torch.Tensor, expert_bias: torch.Tensor, rate: float) -> torch.Tensor:
    """Megatron-Core's get_updated_expert_bias after its all-reduce: [layers, E] -> the new biases."""
    average = tokens_per_expert.sum(dim=-1, keepdim=True) / tokens_per_expert.shape[-1]
    return expert_bias + torch.sign(average - tokens_per_expert) * rate


class ExpertBiasUpdate:
    """The update of every expert bias on this rank's stage (all its model chunks)."""

    def __init__(self, model: torch.nn.Module, rate: float, dp_group=None, tp_group=None):
        """`dp_group`: the stage's data-parallel x CP group; `tp_group`: the TP group where each TP rank routes
        its own tokens (sequence parallelism), else None."""
        self.routers: List[torch.nn.Module] = [m for m in model.modules()
                                               if getattr(m, "expert_bias", None) is not None]
        self.rate = rate
        self.groups = [g for g in (dp_group, tp_group) if g is not None and dist.get_world_size(g) > 1]

    @classmethod
    def of_run(cls, model: torch.nn.Module, config, state) -> "ExpertBiasUpdate":
        """The update of a training run's stage (no routers, a no-op step, without --moe-router-enable-expert-bias)."""
        sp_group = state.tp_group if config.sequence_parallel and state.tp_size > 1 else None
        return cls(model, config.moe_router_bias_update_rate, state.dp_group, sp_group)

    @torch.no_grad()
    def step(self) -> None:
        if not self.routers:
            return
        counts = torch.stack([r.tokens_per_expert for r in self.routers])
        for group in self.groups:
            shm_comm.all_reduce(counts, group)
        new = updated_bias(counts, torch.stack([r.expert_bias for r in self.routers]), self.rate)
        for router, bias in zip(self.routers, new):
            router.expert_bias.copy_(bias)
            router.tokens_per_expert.zero_()
