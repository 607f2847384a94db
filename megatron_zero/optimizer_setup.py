"""The optimizer a run trains with, built from its typed sections: ZeroOptimizer from OptimizerConfig (ZeRO's
stage, precision, loss scaling, offload, overlap, ZeRO++) over the ranks' groups (topology.ParallelState)."""
from __future__ import annotations

from .config.optimizer import OptimizerConfig
from .model.params import is_embedding_or_output
from .topology import build_hpz_group
from .zero import ZeroOptimizer


def param_groups(model, weight_decay: float, decoupled: bool = False):
    """Megatron's two groups: weight decay on matrices and embeddings, none on biases and norms. `decoupled`
    (--decoupled-lr): the word embedding and output layer go into a third group, weight-decayed, marked
    `is_decoupled_lr` (Megatron's key: the optimizer gives it the decoupled learning rate), where this stage
    holds any."""
    decay, no_decay, own_lr = [], [], []
    for name, p in model.named_parameters():
        if p.ndim == 1:
            no_decay.append((name, p))
        else:
            (own_lr if decoupled and is_embedding_or_output(name) else decay).append((name, p))
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    if own_lr:
        groups.append({"params": own_lr, "weight_decay": weight_decay, "is_decoupled_lr": True})
    return groups


def build_optimizer(model, opt: OptimizerConfig, state, device) -> ZeroOptimizer:
    """ZeroOptimizer over `model`'s parameters (this rank's stage) as `opt` says, on `state`'s groups."""
    hpz = opt.zero_hpz_partition_size
    return ZeroOptimizer(
        param_groups(model, opt.weight_decay, opt.decoupled_lr is not None), dp_group=state.dp_group,
        stage=opt.zero_stage, lr=opt.lr, betas=(opt.adam_beta1, opt.adam_beta2), eps=opt.adam_eps,
        weight_decay=opt.weight_decay, clip_grad=opt.clip_grad, mp_group=state.mp_group, tp_rank=state.tp_rank,
        dtype=opt.params_dtype, loss_scaler=opt.loss_scaler(), offload=opt.offload,
        nvme_path=opt.zero_nvme_offload_path, module=model, persistence_threshold=opt.zero_param_persistence_threshold,
        prefetch=opt.overlap_param_gather, overlap_grad_reduce=opt.overlap_grad_reduce,
        overlap_param_gather=opt.overlap_param_gather and opt.zero_stage < 3,
        quantized_weights=opt.zero_quantized_weights, quantized_gradients=opt.zero_quantized_gradients,
        hpz_group=build_hpz_group(state.layout, state.rank, hpz) if hpz > 1 else None, device=device,
        grad_reduce_in_bf16=opt.grad_reduce_in_bf16, cpu_optimizer_threads=opt.cpu_optimizer_threads,
        expert_dp_group=state.expert_dp_group)
