"""The shared expert of an MoE layer (Megatron-Core's SharedExpertMLP; Qwen2-MoE's and DeepSeek's shared expert).

    out = routed experts' output + shared(x)                    --moe-shared-expert-intermediate-size S
    out = routed experts' output + sigmoid(x g^T) * shared(x)   with --moe-shared-expert-gate

`shared` is the dense MLP (GeLU or SwiGLU) of width S, tensor-parallel as the dense MLP is and not
expert-parallel: every token goes through it on every rank, and its gradient reduces over the
data-parallel group like any dense parameter's. The gate's weight g [1, h] is replicated over TP and
EP. Parameter names within the block: `mlp.shared_expert.dense_h_to_4h.*`, `mlp.shared_expert.dense_4h_to_h.*`
and `mlp.shared_expert_gate.weight` (saved in the layer's file, not an expert file).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..tensor_parallel.layers import sequence_parallel_param, sum_sequence_parallel_grad
from ..tensor_parallel.utils import tp_world_size


class SharedExpertGate(nn.Module):
    """`weight` [1, h]: the shared expert's output is scaled by sigmoid(x weight^T) (init.py fills it)."""

    def __init__(self, config, sp_group=None):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(1, config.hidden_size, dtype=config.params_dtype))
        self.sp_group = sp_group  # sequence parallelism: this rank's tokens' gradient, summed over TP
        if sp_group is not None:
            sequence_parallel_param(self.weight)

    def forward(self, x: torch.Tensor, shared_out: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(F.linear(x, sum_sequence_parallel_grad(self.weight, self.sp_group))) * shared_out


def build_shared_expert(config, tp_group, mlp_class):
    """(the shared expert MLP, its gate) for an MoE layer of `config`; (None, None) without one."""
    size = config.moe_shared_expert_intermediate_size
    if not size:
        return None, None
    mlp = mlp_class(config, tp_group, ffn_hidden_size=size)
    sp_group = tp_group if config.sequence_parallel and tp_world_size(tp_group) > 1 else None
    return mlp, (SharedExpertGate(config, sp_group) if config.moe_shared_expert_gate else None)


def add_shared_expert(routed: torch.Tensor, x: torch.Tensor, mlp, gate) -> torch.Tensor:
    """The MoE layer's output: the routed experts' plus the (gated) shared expert's, where the layer has one."""
    if mlp is None:
        return routed
    shared = mlp(x)
    return routed + (shared if gate is None else gate(x, shared))
