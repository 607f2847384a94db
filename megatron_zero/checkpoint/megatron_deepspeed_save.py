"""A save Megatron-DeepSpeed's own --load resumes at the same layout (--save-megatron-deepspeed-layout).

Our files already are DeepSpeed's; what Megatron-DeepSpeed (MDS) needs on top, each file as its engine and
checkpointing.py read it:
  PP = 1     MDS runs --no-pipeline-parallel: the weights nest in mp_rank_*'s `module` (language_model ->
             embedding / encoder, megatron_deepspeed.nest_module), no layer files, and the ZeRO files name
             parameters `language_model.embedding.word_embeddings.weight`, ...
  PP > 1     the pipeline engine: layer files as ours, `module` None (its loader tests `is not None`)
  ZeRO 0     MDS's engine has no ZeRO optimizer: the torch Adam state_dict (per parameter index, Megatron's
             param groups) goes into mp_rank_*'s `optimizer`; no optimizer files
  ZeRO 1/2   optimizer files as ours, with DeepSpeed's own loss scaler and fragment_address objects (written
             under DeepSpeed's class names, storage/safe_pickle.PICKLED_AS) and Megatron's param-group keys
             (name, wd_mult, lr_mult: its scheduler sets each group's lr and weight decay from them)
  client     `args` as a Namespace with consumed_train_samples, num_key_value_heads and the sizes its
             check_checkpoint_args compares; `tokens`; the scheduler's state in samples with every key
             its OptimizerParamScheduler.load_state_dict reads; rng_state entries with cuda_rng_state and
             one accelerator ByteTensor per tracker state
Our loader reads these files back (megatron_deepspeed.py, reshape/dense_source.py), so a run saved so
resumes in ours too.
"""
from __future__ import annotations

import argparse
from collections import OrderedDict
from typing import List, Optional, Tuple

import torch
import torch.distributed as dist

from .errors import CheckpointError
from .deepspeed_layout import param_shapes
from .format import MODEL_FILE, ZERO_FILE
from ..optimizer.lr_schedule import LRSchedule
from ..zero.partition import partition_group
from .megatron_deepspeed import QKV_SUFFIXES, module_name_from_ours, nest_module, qkv_from_ours
from .storage.safe_pickle import DynamicLossScaler, LossScaler, ModelType, fragment_address

# torch.optim.Adam's param-group keys as MDS's optimizer saves them (torch's load_state_dict keeps a saved
# group's keys), and Megatron's own group keys
ADAM_GROUP_KEYS = {"amsgrad": False, "maximize": False, "foreach": None, "capturable": False, "differentiable": False,
                   "fused": None, "decoupled_weight_decay": False}
GROUP_NAMES = ("wd_no_scale_lr", "no_wd_no_scale_lr")


def megatron_group(group: dict, g: int, params: list, next_lr: float) -> dict:
    """One param group as Megatron-DeepSpeed's optimizer saves it (group 0 decayed, group 1 not). Its `lr` is
    the next step's: Megatron-DeepSpeed steps its scheduler after the optimizer, and DeepSpeed's loader restores
    the groups after the scheduler, so the saved lr is the one its next step uses (ours records the last one)."""
    out = {"name": GROUP_NAMES[min(g, 1)], "wd_mult": 1.0 if g == 0 else 0.0, "lr_mult": 1.0}
    out.update({k: group[k] for k in ("betas", "eps", "weight_decay") if k in group})
    out["lr"] = float(next_lr)
    out.update(ADAM_GROUP_KEYS)
    out["params"] = params
    return out


def deepspeed_loss_scaler(state: dict):
    """Our loss scaler's state as DeepSpeed's LossScaler / DynamicLossScaler object (the attributes its
    methods use), which DeepSpeed's ZeRO loader assigns as it is."""
    if not state.get("dynamic"):
        return LossScaler(cur_scale=float(state.get("cur_scale", 1.0)), dynamic=False)
    return DynamicLossScaler(cur_scale=float(state["cur_scale"]), cur_iter=int(state["cur_iter"]),
                             last_overflow_iter=int(state["last_overflow_iter"]),
                             scale_factor=float(state["scale_factor"]), scale_window=int(state["scale_window"]),
                             min_scale=float(state["min_scale"]), delayed_shift=int(state["delayed_shift"]),
                             cur_hysteresis=int(state["cur_hysteresis"]),
                             consecutive_hysteresis=bool(state["consecutive_hysteresis"]),
                             raise_error_at_min_scale=True, dynamic=True, dtype=torch.float16)


def scheduler_state(schedule: dict, args: dict, consumed: int) -> dict:
    """Megatron-DeepSpeed's OptimizerParamScheduler state (it counts samples) for our schedule's state."""
    gbs, seq = int(args["global_batch_size"]), int(args["seq_length"])
    wd = float(args.get("weight_decay", 0.0))
    train_samples = int(args.get("train_iters") or 0) * gbs
    return {"max_lr": float(schedule["max_lr"]), "lr_warmup_steps": int(schedule["lr_warmup_steps"]) * gbs,
            "lr_warmup_tokens": None, "num_steps": consumed, "num_tokens": max(0, consumed - gbs) * seq,
            "lr_decay_style": schedule["lr_decay_style"], "lr_decay_steps": int(schedule["lr_decay_steps"]) * gbs,
            "lr_decay_tokens": None, "min_lr": float(schedule["min_lr"]), "start_wd": wd, "end_wd": wd,
            "wd_incr_style": "constant", "wd_incr_steps": train_samples}


def rng_entry(state: Optional[dict]) -> Optional[dict]:
    """Our RNG state as Megatron's: `cuda_rng_state` (the accelerator's: torch's CPU state on a CPU) and
    one accelerator ByteTensor per tracker state."""
    if state is None:
        return None
    cuda = torch.cuda.is_available()
    tracker = {name: (s["cuda"] if cuda and "cuda" in s else s["cpu"])
               for name, s in (state.get("rng_tracker_states") or {}).items()}
    return {"random_rng_state": state["random_rng_state"], "np_rng_state": state["np_rng_state"],
            "torch_rng_state": state["torch_rng_state"],
            "cuda_rng_state": state.get("cuda_rng_state", state["torch_rng_state"]), "rng_tracker_states": tracker}


def megatron_args(args: dict, layout, consumed: int) -> argparse.Namespace:
    """Our args as the Namespace MDS's checkpointing reads (check_checkpoint_args, consumed samples)."""
    out = dict(args)
    heads = out.get("num_attention_heads")
    out.setdefault("num_key_value_heads", out.get("num_query_groups") or heads)
    learned = str(out.get("position_embedding_type", "learned_absolute")) == "learned_absolute"
    out.update(model_type=ModelType.encoder_or_decoder, consumed_train_samples=consumed, consumed_valid_samples=0,
               tensor_model_parallel_size=layout.tp, pipeline_model_parallel_size=layout.pp,
               add_position_embedding=learned)
    return argparse.Namespace(**out)


def _local_tensors(osd: dict, shapes: List["OrderedDict"]):
    """Per group, name -> (fp32, exp_avg, exp_avg_sq, step) local tensors from a whole (DP 1) partition."""
    out = []
    for g, group in enumerate(shapes):
        fp32 = osd["single_partition_of_fp32_groups"][g]
        st = osd["base_optimizer_state"]["state"][g]
        maps = osd["param_slice_mappings"][g]
        named = OrderedDict()
        for name, shape in group.items():
            frag = maps[name]
            view = lambda t: t.narrow(0, int(frag.start), int(frag.numel)).view(shape)  # noqa: E731
            named[name] = (view(fp32), view(st["exp_avg"]), view(st["exp_avg_sq"]), st["step"])
        out.append(named)
    return out


def next_lr(schedule: dict) -> float:
    """The learning rate of the step after the saved one, from our schedule's state."""
    return LRSchedule(schedule["max_lr"], schedule["min_lr"], schedule["lr_warmup_steps"], schedule["lr_decay_steps"],
                      schedule["lr_decay_style"], schedule["num_steps"]).lr()


def dense_optimizer(osd: dict, shapes: List["OrderedDict"], lr: float) -> dict:
    """Our stage-0 optimizer state (one whole partition) as the torch Adam state_dict MDS's engine loads."""
    state, groups, index = {}, [], 0
    for g, named in enumerate(_local_tensors(osd, shapes)):
        ids = []
        for _, (_, m, v, step) in named.items():
            state[index] = {"step": step.clone(), "exp_avg": m, "exp_avg_sq": v}
            ids.append(index)
            index += 1
        groups.append(megatron_group(osd["base_optimizer_state"]["param_groups"][g], g, ids, lr))
    return {"state": state, "param_groups": groups}


def _qkv_local(name: str) -> bool:
    return name.endswith(QKV_SUFFIXES)


def permuted_partitions(osd: dict, shapes: List["OrderedDict"], heads: int, groups: int, dp_rank: int, dp: int,
                        dp_group) -> Tuple[list, list]:
    """(fp32 partitions, base_optimizer_state) with every fused QKV in Megatron-DeepSpeed's [Q; K; V] order.

    A QKV parameter's rows move across the whole tensor, and under ZeRO-1/2 its elements may lie on several
    DP ranks: each is assembled (every rank adds its fragment, one all-reduce over DP per parameter and state),
    permuted, and each rank takes back its fragment. The live state is not touched (copies are written)."""
    fp32 = [t.clone() for t in osd["single_partition_of_fp32_groups"]]
    base = osd["base_optimizer_state"]
    state = {g: {k: (v.clone() if k in ("exp_avg", "exp_avg_sq") else v) for k, v in base["state"][g].items()}
             for g in base["state"]}
    for g, group in enumerate(shapes):
        part = partition_group([(n, int(torch.Size(s).numel())) for n, s in group.items()], dp)
        lo, _ = part.bounds(dp_rank)
        for name, off, numel in zip(part.names, part.offsets, part.numels):
            if not _qkv_local(name):
                continue
            tensors = [fp32[g], state[g]["exp_avg"], state[g]["exp_avg_sq"]]
            a, b = max(off, lo), min(off + numel, lo + part.partition_size)
            full = tensors[0].new_zeros(3, numel)
            for k, t in enumerate(tensors):
                if a < b:
                    full[k, a - off:b - off] = t[a - lo:b - lo]
            if dp > 1:
                dist.all_reduce(full, group=dp_group)
            shape = group[name]
            for k, t in enumerate(tensors):
                if a < b:
                    t[a - lo:b - lo] = qkv_from_ours(full[k].view(shape), heads, groups).reshape(-1)[a - off:b - off]
    return fp32, {"state": state, "param_groups": base["param_groups"]}


def _rename_groups(groups, rename):
    return [OrderedDict((rename(n), v) for n, v in g.items()) for g in groups]


def _heads(config, tp: int) -> Tuple[int, int]:
    groups = config.num_query_groups or config.num_attention_heads
    if groups % tp:
        raise CheckpointError(f"--save-megatron-deepspeed-layout: {groups} key-value heads do not split over TP={tp} "
                              "(Megatron-DeepSpeed does not replicate key-value heads)")
    return config.num_attention_heads // tp, groups // tp


def megatron_deepspeed_plan(plan: List[Tuple[str, object]], state, model, optimizer,
                            client: dict) -> List[Tuple[str, object]]:
    """Rewrite this rank's save plan (save.build_plan's) into Megatron-DeepSpeed's layout."""
    layout, stage = state.layout, optimizer.stage
    if stage == 3:
        raise CheckpointError("--save-megatron-deepspeed-layout: Megatron-DeepSpeed's ZeRO-3 checkpoints are not "
                              "written; save at ZeRO stage 0, 1 or 2")
    if stage == 0 and optimizer.partition_count > 1:
        raise CheckpointError("--save-megatron-deepspeed-layout at ZeRO stage 0 needs DP=1 (Megatron-DeepSpeed "
                              "without ZeRO keeps one optimizer state per model-parallel rank); use --zero-stage 1")
    num_layers = model.config.num_layers
    pipeline = layout.pp > 1
    rename = (lambda n: n) if pipeline else (lambda n: module_name_from_ours(n, num_layers))  # noqa: E731
    args = dict(client["args"]) if isinstance(client["args"], dict) else vars(client["args"])
    consumed = int(client.get("consumed_train_samples", 0) or 0)
    heads, groups = _heads(model.config, layout.tp)
    lr = next_lr(client["lr_scheduler"])
    shapes = param_shapes(optimizer, dict(model.named_parameters()))
    out, osd = [], None
    for name, obj in plan:
        if ZERO_FILE.match(name):
            osd = dict(obj["optimizer_state_dict"])
            osd["single_partition_of_fp32_groups"], osd["base_optimizer_state"] = permuted_partitions(
                osd, shapes, heads, groups, state.dp_rank, optimizer.partition_count, state.dp_group)
            if stage == 0:
                continue
            sd = dict(osd)
            sd["loss_scaler"] = deepspeed_loss_scaler(osd["loss_scaler"])
            sd["param_slice_mappings"] = [OrderedDict((rename(n), fragment_address(numel=int(f.numel),
                                                                                   start=int(f.start)))
                                                      for n, f in g.items()) for g in osd["param_slice_mappings"]]
            base = osd["base_optimizer_state"]
            sd["base_optimizer_state"] = {"state": base["state"], "param_groups": [
                megatron_group(grp, g, [g], lr) for g, grp in enumerate(base["param_groups"])]}
            out.append((name, {**obj, "optimizer_state_dict": sd}))
        elif name.startswith("layer_") and not pipeline:
            continue  # the non-pipeline model keeps its weights in `module`
        elif name.startswith("layer_"):
            out.append((name, OrderedDict((k, qkv_from_ours(v, heads, groups) if _qkv_local(k) else v)
                                          for k, v in obj.items())))
        else:
            out.append((name, obj))
    for i, (name, obj) in enumerate(out):
        if not MODEL_FILE.match(name):
            continue
        states = dict(obj)
        if stage == 0:
            states["optimizer"] = dense_optimizer(osd, shapes, lr)
            states["param_shapes"] = None
        else:
            states["param_shapes"] = _rename_groups(shapes, rename)
        states["module"] = None if pipeline else nest_module(OrderedDict(
            (rename(n), qkv_from_ours(t, heads, groups) if _qkv_local(n) else t)
            for n, t in model.state_dict().items()))
        states["shared_params"] = {} if stage > 0 else None
        states["frozen_param_shapes"] = states["frozen_param_fragments"] = None
        states["checkpoint_parallel_dimensions"] = {"pp_degree": layout.pp, "tp_degree": layout.tp}
        states["lr_scheduler"] = scheduler_state(states["lr_scheduler"], args, consumed)
        states["args"] = megatron_args(args, layout, consumed)
        states["tokens"] = consumed * int(args["seq_length"])
        states["rng_state"] = [rng_entry(r) for r in states.get("rng_state") or []]
        out[i] = (name, states)
    return out
