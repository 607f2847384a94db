"""ZeroOptimizer.state_dict / load_state_dict in DeepSpeed's ZeRO layout.

Stage 0/1/2 (what DeepSpeed's zero_to_fp32.py and ds_to_universal.py read):
  base_optimizer_state            torch AdamW state_dict over one flat param per group:
                                  {'state': {g: {'step', 'exp_avg', 'exp_avg_sq'}}, 'param_groups'}
                                  (flat tensors are the whole padded partition)
  single_partition_of_fp32_groups this rank's fp32 master partition per group, padding stripped
  param_slice_mappings            per group: name -> fragment_address(numel, start)
  group_paddings, partition_count, zero_stage, loss_scaler, dynamic_loss_scale, overflow, clip_grad
Stage 3:
  fp32_flat_groups (per-parameter chunks, each padded to ceil(numel/dp)), optimizer_state_dict
  (the same torch AdamW state_dict), zero_stage, partition_count, loss_scaler, dynamic_loss_scale,
  overflow. With expert parallelism (expert groups chunked over expert-DP) also partition_count as a
  list per group and param_slice_mappings (each parameter's real elements in the rank's flat group).
Tensors are the live buffers (not copies) except under NVMe offload, where they are read
from the files; save them before the next step.
"""
from __future__ import annotations

import torch

DS_VERSION = "0.19.8"  # `ds_version`: the DeepSpeed release whose layout and keys we write (checkpoint/format.py)


def _base_state(opt) -> dict:
    state, groups = {}, []
    for g, group in enumerate(opt.optimizer.param_groups):
        state[g] = opt.optimizer.state(g)
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": [g]})
    return {"state": state, "param_groups": groups}


def state_dict(opt) -> dict:
    with opt.optimizer.paged() as masters:
        base = _base_state(opt)
        common = {"loss_scaler": opt.loss_scaler.state_dict(),
                  "dynamic_loss_scale": opt.loss_scaler.dynamic, "overflow": opt.overflow,
                  "partition_count": opt.partition_count, "ds_version": DS_VERSION}
        counts = getattr(opt.impl, "group_partition_counts", None)
        if opt.stage == 3:
            # with expert parallelism (zero/expert_stage3.py) the expert groups are chunked over expert-DP:
            # a count per group, and where each parameter's real elements lie in this rank's flat group
            experts = {"partition_count": counts(), "param_slice_mappings": opt.param_slice_mappings()} if counts else {}
            return {**common, "zero_stage": 3, "optimizer_state_dict": base,
                    "fp32_flat_groups": [m.data for m in masters], **experts}
        paddings = opt.impl.group_paddings()
        lean = [m.data[:m.numel() - pad] for m, pad in zip(masters, paddings)]
        # DeepSpeed's stage 1/2 records one partition count per param group (its ds_to_universal needs the list)
        # (with expert parallelism the expert groups' count is the expert-DP size: zero/expert_stage.py)
        common["partition_count"] = counts() if counts else [opt.partition_count] * len(masters)
        return {**common, "zero_stage": opt.stage, "clip_grad": opt.clip_grad,
                "base_optimizer_state": base, "single_partition_of_fp32_groups": lean,
                "param_slice_mappings": opt.param_slice_mappings(), "group_paddings": paddings}


def _check(opt, sd: dict):
    stage = int(sd.get("zero_stage", -1))
    same_family = (stage == 3) == (opt.stage == 3)
    if not same_family:
        raise ValueError(f"this optimizer state was saved at ZeRO stage {stage} and cannot be loaded "
                         f"directly at stage {opt.stage}; convert it through a universal checkpoint")
    count = sd.get("partition_count")
    count = max(count) if isinstance(count, (list, tuple)) else count
    if count != opt.partition_count:
        raise ValueError(f"this optimizer state was partitioned over {count} data-parallel ranks but "
                         f"the run has {opt.partition_count}; convert it through a universal checkpoint")


def _padded(t: torch.Tensor, numel: int) -> torch.Tensor:
    flat = t.detach().float().reshape(-1)
    if flat.numel() > numel:
        raise ValueError(f"a saved flat optimizer tensor has {flat.numel()} elements, more than the "
                         f"partition's {numel}; the checkpoint does not match this model")
    return torch.cat([flat, flat.new_zeros(numel - flat.numel())]) if flat.numel() < numel else flat


def load_state_dict(opt, sd: dict) -> None:
    _check(opt, sd)
    if opt.stage == 3:
        fp32, base = sd["fp32_flat_groups"], sd["optimizer_state_dict"]
    else:
        fp32, base = sd["single_partition_of_fp32_groups"], sd["base_optimizer_state"]
    if len(fp32) != len(opt.names):
        raise ValueError(f"the saved optimizer state has {len(fp32)} param groups, the model {len(opt.names)}")
    with opt.optimizer.paged() as masters:
        for g, m in enumerate(masters):
            n = m.numel()
            st = base["state"].get(g, {}) if isinstance(base["state"], dict) else base["state"][g]
            state = {"step": st.get("step", torch.tensor(0.0)),
                     **{k: _padded(st[k], n) for k in ("exp_avg", "exp_avg_sq") if k in st}}
            opt.optimizer.set_state(g, state, _padded(fp32[g], n))
            saved = base.get("param_groups", [])
            if g < len(saved):
                for k in ("lr", "betas", "eps", "weight_decay"):
                    if k in saved[g]:
                        opt.optimizer.param_groups[g][k] = saved[g][k]
        opt.impl.write_weights(masters)
    if sd.get("loss_scaler") is not None:
        opt.loss_scaler.load_state_dict(sd["loss_scaler"])
    opt.overflow = bool(sd.get("overflow", False))
