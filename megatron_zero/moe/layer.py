"""The MoE layer that replaces a transformer block's MLP: router, permutation, experts, unpermutation.

Experts are the dense MLP (GeLU or SwiGLU, width moe_ffn_hidden_size), tensor-parallel like it
(column- then row-parallel over the TP group: every TP rank routes the same tokens the same way and
holds its slice of every local expert). With an expert-parallel group of EP ranks, this rank holds
experts [ep_rank E/EP, (ep_rank+1) E/EP) under their global ids, marked `expert_parallel` (their
gradients reduce over the expert-data-parallel group, zero/expert_stage.py); the router is replicated.
Routing: Megatron-Core's top-k router (router.py; dropless, or with `moe_expert_capacity_factor` its
capacity, token_dropping.py), or with `moe_capacity_factor` set
DeepSpeed-MoE's capacity gating (capacity_gating.py: tokens past an expert's capacity are dropped, their
MoE output is zero). The experts run one after another on their contiguous runs of rows (a loop over
the local experts, never over tokens), or with `moe_grouped_gemm` all together as one grouped GEMM per
matmul (grouped_mlp.py; the same parameters). Dispatch over the EP group: the all-to-all (dispatch.py), or
with `moe_token_dispatcher_type` "allgather" Megatron-Core's all-gather dispatcher (allgather_dispatch.py).

With sequence parallelism (or TP = 1) each rank routes its own tokens; the experts are then
tensor-parallel over the expert-tensor-parallel group (`etp_group`, --expert-tensor-parallel-size; the TP
group when None): after the EP exchange the rows of the ETP group are gathered, run through the local
experts' slices and reduce-scattered back (expert_tp.py). The router weight's gradient, each TP rank's
tokens' part, is then summed over TP in backward. With context parallelism (`cp_group`) each CP rank routes
its chunks of the sequences; the router's losses count the tokens routed over the CP group (router.py).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .allgather_dispatch import allgather_dispatch
from .capacity_gating import capacity_route
from ..tensor_parallel.layers import sequence_parallel_param, sum_sequence_parallel_grad
from ..tensor_parallel.random import checkpoint
from ..tensor_parallel.utils import tp_rank_in, tp_world_size
from .dispatch import ExpertParallelExchange, permute, unpermute
from .expert_bias import add_expert_bias, record
from .expert_tp import ExpertTensorParallelRows, experts_over_etp
from .grouped_mlp import GroupedMLP
from .router import route
from .shared_expert import add_shared_expert, build_shared_expert
from .token_dropping import kept_pairs, megatron_token_order


class Experts(nn.Module):
    """`deepspeed_experts`: this rank's experts, keyed by global expert id."""

    def __init__(self, config, tp_group, expert_ids, mlp_class):
        super().__init__()
        self.deepspeed_experts = nn.ModuleDict(
            {str(e): mlp_class(config, tp_group, ffn_hidden_size=config.moe_ffn_hidden_size) for e in expert_ids})
        for p in self.deepspeed_experts.parameters():
            p.expert_parallel = True
            # the slice of the expert this rank holds (init.py), and which copy of a replicated one counts
            # in the gradient norm (zero/clip_grad.py)
            p.expert_tp_size, p.expert_tp_rank = tp_world_size(tp_group), tp_rank_in(tp_group)
        self.grouped = GroupedMLP(config, tp_group) if config.moe_grouped_gemm else None

    def forward(self, rows: torch.Tensor, rows_per_expert) -> torch.Tensor:
        if self.grouped is not None:
            return self.grouped(list(self.deepspeed_experts.values()), rows, rows_per_expert)
        chunks = torch.split(rows, list(rows_per_expert))
        return torch.cat([expert(chunk) for expert, chunk in zip(self.deepspeed_experts.values(), chunks)])


class RouterWeight(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(config.num_experts, config.hidden_size, dtype=config.params_dtype))


class Gate(nn.Module):
    """The router's weight `wg.weight` [E, h] (replicated over TP and EP; init.py fills it, no RNG draw here)
    and, with --moe-router-enable-expert-bias, its `expert_bias` [E] (expert_bias.py)."""

    def __init__(self, config):
        super().__init__()
        self.wg = RouterWeight(config)
        if config.moe_router_enable_expert_bias:
            add_expert_bias(self, config.num_experts)


class DeepSpeedMoE(nn.Module):
    def __init__(self, config, tp_group, ep_group, mlp_class, etp_group=None, cp_group=None):
        super().__init__()
        if ep_group is not None and dist.get_world_size(ep_group) == 1:
            ep_group = None
        self.config, self.ep_group, self.cp_group = config, ep_group, cp_group
        sequence_parallel = config.sequence_parallel and tp_world_size(tp_group) > 1
        self.sp_group = tp_group if sequence_parallel else None
        own_tokens = sequence_parallel or tp_world_size(tp_group) == 1  # else every TP rank routes the same
        expert_tp = tp_group if etp_group is None else etp_group
        if not own_tokens and tp_world_size(expert_tp) != tp_world_size(tp_group):
            raise ValueError(f"--expert-tensor-parallel-size {tp_world_size(expert_tp)} other than "
                             f"--tensor-model-parallel-size {tp_world_size(tp_group)} needs --sequence-parallel")
        if sequence_parallel and (config.moe_capacity_factor is not None
                                  or config.moe_expert_capacity_factor is not None):
            raise ValueError("--sequence-parallel with MoE layers routes each TP rank's tokens alone: expert "
                             "capacity is not available with it")
        self.etp_group = expert_tp if own_tokens and tp_world_size(expert_tp) > 1 else None
        if self.etp_group is not None and config.moe_token_dispatcher_type == "allgather":
            raise ValueError("--moe-token-dispatcher-type allgather runs experts whole on every TP rank's same "
                             "tokens; with --sequence-parallel or --expert-tensor-parallel-size use alltoall")
        ep = dist.get_world_size(ep_group) if ep_group is not None else 1
        ep_rank = dist.get_rank(ep_group) if ep_group is not None else 0
        self.local = config.num_experts // ep
        self.first = ep_rank * self.local
        self.gate = Gate(config)
        if sequence_parallel:
            sequence_parallel_param(self.gate.wg.weight)
        self.experts = Experts(config, expert_tp if own_tokens else tp_group,
                               range(self.first, self.first + self.local), mlp_class)

    def forward(self, x):
        c = self.config
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        weight = sum_sequence_parallel_grad(self.gate.wg.weight, self.sp_group)
        if c.moe_router_dtype == "fp32":  # the router's GEMM itself in fp32 (Megatron-Core's --moe-router-dtype)
            tokens_in, weight = tokens.float(), weight.float()
        else:
            tokens_in = tokens
        logits = F.linear(tokens_in, weight).float()
        if c.moe_capacity_factor is None:
            weights, expert_ids = route(logits, c.moe_router_topk, c.moe_router_pre_softmax,
                                        c.moe_router_load_balancing_type, c.moe_aux_loss_coeff, c.moe_z_loss_coeff,
                                        c.moe_router_score_function, c.moe_router_topk_scaling_factor, shape[0],
                                        self.training, self.cp_group, self.sp_group, c.moe_router_num_groups,
                                        c.moe_router_group_topk, getattr(self.gate, "expert_bias", None))
            if c.moe_expert_capacity_factor is not None:  # Megatron-Core's capacity (token_dropping.py)
                kept = kept_pairs(weights, expert_ids, c.num_experts, c.moe_expert_capacity_factor,
                                  c.moe_token_drop_policy, shape[0])
                expert_ids = torch.where(kept, expert_ids, c.num_experts)
        else:
            factor = c.moe_capacity_factor if self.training else c.moe_eval_capacity_factor
            # DeepSpeed gates Megatron-DeepSpeed's [s, b] tokens: its capacity keeps (and its random token
            # selection draws) in that order, ours are [b, s]
            order = megatron_token_order(shape[0], tokens.shape[0] // shape[0], logits.device)
            routed = capacity_route(logits.index_select(0, order), c.moe_router_topk, factor, c.moe_min_capacity,
                                    c.moe_drop_tokens, c.moe_use_rts, c.moe_top2_2nd_expert_sampling,
                                    c.moe_aux_loss_coeff)
            ours = torch.empty_like(order).index_copy_(0, order, torch.arange(order.numel(), device=order.device))
            weights, expert_ids, kept = (t.index_select(0, ours) for t in routed)
            expert_ids = torch.where(kept, expert_ids, c.num_experts)  # dropped: sorted past every expert
        counts = torch.bincount(expert_ids.reshape(-1), minlength=c.num_experts + 1)[:c.num_experts]
        if c.moe_router_enable_expert_bias:
            record(self.gate, counts)
        if self.ep_group is not None and c.moe_token_dispatcher_type == "allgather":
            out = allgather_dispatch(tokens, weights, expert_ids, self.experts, self.ep_group, self.first, self.local)
            return out.view(shape)
        if self.ep_group is None and self.etp_group is None:
            rows_per_expert = counts.tolist()  # the layer's one host read
            rows, order, token_of_row = permute(tokens, expert_ids, sum(rows_per_expert))
            out = self.experts(rows, rows_per_expert)
        elif self.ep_group is None:
            over_etp = ExpertTensorParallelRows(counts, self.etp_group)
            rows, order, token_of_row = permute(tokens, expert_ids, sum(over_etp.mine))
            out = self._run_experts(rows, over_etp)
        else:
            exchange = ExpertParallelExchange(counts, self.ep_group, self.local)
            rows, order, token_of_row = permute(tokens, expert_ids, sum(exchange.send))
            got = exchange.to_experts(rows)
            if self.etp_group is None:
                out = self.experts(got, exchange.rows_per_local_expert)
            else:
                local_counts = exchange.received.view(-1, self.local).sum(dim=0)
                out = self._run_experts(got, ExpertTensorParallelRows(local_counts, self.etp_group))
            out = exchange.from_experts(out)
        return unpermute(out, weights, order, token_of_row, tokens.shape[0]).view(shape)


    def _run_experts(self, rows, over_etp):
        return experts_over_etp(list(self.experts.deepspeed_experts.values()), rows, over_etp, self.config.swiglu,
                                self.config.moe_grouped_gemm)


class MoELayer(nn.Module):
    """A block's `mlp` when the block is an MoE layer (parameter names: `mlp.deepspeed_moe.*`, and with a
    shared expert `mlp.shared_expert.*`, `mlp.shared_expert_gate.weight`: shared_expert.py)."""

    def __init__(self, config, tp_group=None, ep_group=None, mlp_class=None, etp_group=None, cp_group=None):
        super().__init__()
        self.deepspeed_moe = DeepSpeedMoE(config, tp_group, ep_group, mlp_class, etp_group, cp_group)
        self.shared_expert, self.shared_expert_gate = build_shared_expert(config, tp_group, mlp_class)
        self.recompute = config.moe_layer_recompute  # --moe-layer-recompute: only the input kept for backward

    def forward(self, x):
        if self.recompute and self.training:
            return checkpoint(self._forward, x)
        return self._forward(x)

    def _forward(self, x):
        return add_shared_expert(self.deepspeed_moe(x), x, self.shared_expert, self.shared_expert_gate)
