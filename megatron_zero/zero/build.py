"""The optimizer a run trains with, built from its typed sections: ZeroOptimizer from OptimizerConfig (ZeRO's
stage, precision, loss scaling, offload, overlap, ZeRO++) over the ranks' groups (topology.ParallelState)."""
from __future__ import annotations

from typing import Optional

from ..config.muon import MuonConfig
from ..config.optimizer import OptimizerConfig
from ..model.params import is_embedding_or_output
from ..model.converters import NO_CONVERTERS, ModelConverters
from ..optimizer.muon import MuonSettings, takes_muon
from ..distributed.topology import build_hpz_group
from . import ZeroOptimizer


def param_groups(model, weight_decay: float, decoupled: bool = False, muon: bool = False):
    """Megatron's two groups: weight decay on matrices and embeddings, none on biases and norms. `decoupled`
    (--decoupled-lr): the word embedding and output layer go into a third group, weight-decayed, marked
    `is_decoupled_lr` (Megatron's key: the optimizer gives it the decoupled learning rate), where this stage
    holds any. `muon`: the blocks' matrices (optimizer/muon.py's takes_muon) first, in a group of their own marked
    `muon` (weight-decayed), where this stage holds any."""
    members = {"decay": [], "no_decay": [], "own_lr": [], "muon": []}
    for name, p in model.named_parameters():
        members[param_group_kind(name, p.shape, decoupled, muon)].append((name, p))
    decay, no_decay, own_lr, matrices = (members[k] for k in ("decay", "no_decay", "own_lr", "muon"))
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    if matrices:
        groups.insert(0, {"params": matrices, "weight_decay": weight_decay, "muon": True})
    if own_lr:
        groups.append({"params": own_lr, "weight_decay": weight_decay, "is_decoupled_lr": True})
    return groups


def param_group_kind(name: str, shape, decoupled: bool = False, muon: bool = False) -> str:
    """Which of param_groups' groups a parameter joins: no_decay, muon, own_lr or decay (the planner's too)."""
    if len(shape) == 1:
        return "no_decay"
    if muon and takes_muon(name, shape):
        return "muon"
    return "own_lr" if decoupled and is_embedding_or_output(name) else "decay"


def muon_settings(muon: MuonConfig, config) -> MuonSettings:
    """Muon's settings from its flags and the model config's attention (the QKV split's rows per query group)."""
    q_rows = config.num_attention_heads // config.num_query_groups * config.head_dim
    return MuonSettings(muon.muon_momentum, muon.muon_use_nesterov, muon.muon_split_qkv, muon.muon_scale_mode,
                        muon.muon_fp32_matmul_prec, muon.muon_num_ns_steps, muon.muon_tp_mode,
                        muon.muon_extra_scale_factor, (q_rows, config.head_dim, config.head_dim))


def build_optimizer(model, opt: OptimizerConfig, state, device, muon: Optional[MuonConfig] = None,
                    converters: ModelConverters = NO_CONVERTERS) -> ZeroOptimizer:
    """ZeroOptimizer over `model`'s parameters (this rank's stage) as `opt` says, on `state`'s groups; with
    `muon` saying --optimizer muon/dist_muon, the blocks' matrices step by Muon. `converters`: the model converters that
    converted `model`; ZeRO gathers the weights one of them names in its format (--fp8-param-gather: FP8)."""
    hpz = opt.zero_hpz_partition_size
    with_muon = muon is not None and muon.is_muon
    return ZeroOptimizer(
        param_groups(model, opt.weight_decay, opt.decoupled_lr is not None, with_muon), dp_group=state.dp_group,
        stage=opt.zero_stage, lr=opt.lr, betas=(opt.adam_beta1, opt.adam_beta2), eps=opt.adam_eps,
        weight_decay=opt.weight_decay, clip_grad=opt.clip_grad, mp_group=state.mp_group, tp_rank=state.tp_rank,
        dtype=opt.params_dtype, loss_scaler=opt.loss_scaler(), offload=opt.offload, bucket_size=opt.ddp_bucket_size,
        nvme_path=opt.zero_nvme_offload_path, module=model, persistence_threshold=opt.zero_param_persistence_threshold,
        prefetch=opt.overlap_param_gather, overlap_grad_reduce=opt.overlap_grad_reduce,
        overlap_param_gather=opt.overlap_param_gather and opt.zero_stage < 3,
        quantized_weights=opt.zero_quantized_weights, quantized_gradients=opt.zero_quantized_gradients,
        hpz_group=build_hpz_group(state.layout, state.rank, hpz) if hpz > 1 else None, device=device,
        grad_reduce_in_bf16=opt.grad_reduce_in_bf16, cpu_optimizer_threads=opt.cpu_optimizer_threads,
        expert_dp_group=state.expert_dp_group, muon=muon_settings(muon, model.config) if with_muon else None,
        tp_group=state.tp_group, expert_tp_group=state.expert_tp_group,
        **weight_gathers(converters, model, state.dp_group, state.expert_dp_group, device))


def weight_gathers(converters, model, dp_group, expert_dp_group, device) -> dict:
    """ZeroOptimizer's `fp8_gather` and `expert_fp8_gather` from the converters' `weight_gather`: with expert
    parallelism the experts' weights over expert-DP and the others over DP; without, all over DP."""
    if expert_dp_group is None:
        return {"fp8_gather": converters.weight_gather(model, dp_group, device), "expert_fp8_gather": None}
    return {"fp8_gather": converters.weight_gather(model, dp_group, device, False),
            "expert_fp8_gather": converters.weight_gather(model, expert_dp_group, device, True)}
