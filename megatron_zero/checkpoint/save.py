"""save_checkpoint: every rank writes its own files of the DeepSpeed layout, in parallel.

    save_checkpoint(save_dir, iteration, state, model, optimizer, client_state,
                    async_save=False, keep_last_k=None)

client_state (Megatron-DeepSpeed's): args, iteration, lr_scheduler, rng_state (this rank's),
consumed samples, ... It goes into the model-states files; `rng_state` is gathered over the DP
group and stored as Megatron's per-DP-rank list, so every rank gets its own back.
client_state["weights_only"] (--no-save-optim, --save-weights-interval): the ZeRO files keep the fp32
master partitions and their layout (what zero_to_fp32.py and ds_to_universal read) but no Adam moments,
step or loss scale (`weights_only_state`); loading one starts a fresh optimizer.
"""
from __future__ import annotations

import argparse
import os
from typing import Optional

import torch
import torch.distributed as dist

from ..model.converters import NO_CONVERTERS, ModelConverters
from ..distributed.topology import ParallelState
from .expert_layout import expert_files, without_experts, zero3_expert_files
from .deepspeed_layout import assign_layers_to_dp, engine_state, layer_state_dicts, universal_checkpoint_info
from .megatron_deepspeed_save import megatron_deepspeed_plan
from .format import CHECKPOINT_VERSION, DS_VERSION, layer_file_name, model_states_name, optim_states_name
from .storage.writer import CopyFile, get_writer

_HERE = os.path.dirname(os.path.abspath(__file__))
ZERO_TO_FP32 = os.path.join(_HERE, "export", "standalone_zero_to_fp32.py")  # copied as zero_to_fp32.py
SAFE_PICKLE = os.path.join(_HERE, "storage", "safe_pickle.py")  # zero_to_fp32.py imports it from beside itself


def ds_config(optimizer) -> dict:
    """A DeepSpeed-style config describing the optimizer (recorded as `ds_config`)."""
    return {"zero_optimization": {"stage": optimizer.stage,
                                  "offload_optimizer": {"device": getattr(optimizer, "offload", "none")}},
            "bf16": {"enabled": optimizer.dtype == torch.bfloat16},
            "fp16": {"enabled": optimizer.dtype == torch.float16},
            "gradient_clipping": optimizer.clip_grad}


def _gather_dp(value, state: ParallelState):
    if state.dp_size == 1:
        return [value]
    out = [None] * state.dp_size
    dist.all_gather_object(out, value, group=state.dp_group)
    return out


def _client(client_state: dict, state: ParallelState, iteration: int) -> dict:
    client = dict(client_state)
    if isinstance(client.get("args"), dict):  # Megatron stores an argparse.Namespace
        client["args"] = argparse.Namespace(**client["args"])
    client["rng_state"] = _gather_dp(client.get("rng_state"), state)
    client.setdefault("iteration", iteration)
    client.setdefault("checkpoint_version", CHECKPOINT_VERSION)
    return client


def weights_only_state(osd: dict) -> dict:
    """A ZeRO optimizer state dict without Adam's moments, step and loss scale: the fp32 masters only."""
    sd = dict(osd)
    key = "optimizer_state_dict" if sd.get("zero_stage") == 3 else "base_optimizer_state"
    sd[key] = {"state": {}, "param_groups": sd[key].get("param_groups", [])}
    sd["loss_scaler"] = None
    return sd


def build_plan(iteration: int, state: ParallelState, model, optimizer, client: dict,
               converters: ModelConverters = NO_CONVERTERS):
    """[(file name, object)] this rank writes; the model-states file with the entries the model converters add
    (their training state outside the model's state dict: FP8 delayed scaling's amax histories)."""
    tp, mp, dp_rank = state.tp_rank, state.mp_rank, state.dp_rank
    stage = optimizer.stage
    config = model.config
    cfg = ds_config(optimizer)
    osd = optimizer.state_dict()
    kept = converters.state_dict(model, state.dp_group)  # collective where a converter's state is
    plan = [(optim_states_name(dp_rank, mp, optimizer.dtype == torch.bfloat16),
             {"optimizer_state_dict": weights_only_state(osd) if client.get("weights_only") else osd,
              "ds_config": cfg, "ds_version": DS_VERSION})]
    if stage == 3 or dp_rank == 0:
        consumed = int(client.get("consumed_train_samples", 0) or 0)
        states = engine_state(model, optimizer, iteration, consumed, state.dp_size, state.layout.mp_size, cfg,
                              client.get("lr_scheduler"), int(client.get("skipped_steps", 0) or 0))
        states["universal_checkpoint_info"] = universal_checkpoint_info(config, config.padded_vocab_size(state.tp_size))
        states.update({k: v for k, v in client.items() if k not in states})
        states.update(kept)
        plan.append((model_states_name(mp, stage, dp_rank), states))
    if stage == 3 and config.num_experts is not None:  # the DeepSpeed-MoE files at ZeRO-3 too (expert_layout.py)
        plan += list(zero3_expert_files(model, config, mp, writes=dp_rank < state.ep_size).items())
    if stage < 3:
        model_sd = model.state_dict()
        if config.num_experts is not None:  # experts in their own files, by the first rank of their expert-DP group
            if _expert_dp_rank(state) == 0:  # named by the expert slices' model-parallel rank (pp x ETP + etp)
                plan += list(expert_files(model_sd, config, getattr(state, "expert_mp_rank", mp)).items())
            model_sd = without_experts(model_sd)
        layers = layer_state_dicts(model_sd, model.layer_indices)
        nbytes = {i: sum(t.numel() * t.element_size() for t in sd.values()) for i, sd in layers.items()}
        owner = assign_layers_to_dp(nbytes, state.dp_size)
        plan += [(layer_file_name(i, tp), sd) for i, sd in layers.items() if owner[i] == dp_rank]
    if state.rank == 0:
        plan.append(("zero_to_fp32.py", CopyFile(ZERO_TO_FP32, executable=True)))
        plan.append(("safe_pickle.py", CopyFile(SAFE_PICKLE)))
    return plan


def saved_layout(state: ParallelState, model) -> dict:
    """The layout a checkpoint records (and a resume compares): TP, PP, DP, the model chunks per
    pipeline rank ("vp") of an interleaved pipeline, the context-parallel size ("cp": the ZeRO files
    then number DP x CP per model-parallel rank) and the expert-parallel size ("ep"), each above 1, and the
    expert-tensor-parallel size ("etp") where it is not TP (expert files then numbered pp x ETP + etp)."""
    layout = state.layout
    vp = len(getattr(model, "chunks", [None]))
    ep = getattr(state, "ep_size", 1)
    etp = getattr(state, "etp_size", None) or layout.tp
    return {"tp": layout.tp, "pp": layout.pp, "dp": layout.dp, **({"vp": vp} if vp > 1 else {}),
            **({"cp": layout.cp} if layout.cp > 1 else {}), **({"ep": ep} if ep > 1 else {}),
            **({"etp": etp} if etp != layout.tp else {})}


def _expert_dp_rank(state) -> int:
    return state.expert_dp_rank if hasattr(state, "expert_dp_rank") else state.dp_rank // getattr(state, "ep_size", 1)


def save_checkpoint(save_dir: str, iteration: int, state: ParallelState, model, optimizer, client_state: dict,
                    async_save: bool = False, keep_last_k: Optional[int] = None, tag: Optional[str] = None,
                    save_latest: bool = True, megatron_deepspeed: bool = False,
                    converters: ModelConverters = NO_CONVERTERS) -> str:
    """Collective. Returns the tag. With async_save, returns at once; the optimizer's next step waits
    until the background writer has read the state (writer.py). megatron_deepspeed: the files Megatron-DeepSpeed's
    own --load resumes at this layout (megatron_deepspeed_save.py). `converters`: the run's model converters
    (model/converters.py), whose training state the model-states files carry."""
    tag = tag or f"global_step{iteration}"
    writer = get_writer()
    writer.wait()  # the previous async save must be done before its buffers/state are reused
    client = _client(client_state, state, iteration)
    plan = build_plan(iteration, state, model, optimizer, client, converters)
    if megatron_deepspeed:
        plan = megatron_deepspeed_plan(plan, state, model, optimizer, client)
    meta = {"layout": saved_layout(state, model), "zero_stage": optimizer.stage,
            **({"megatron_deepspeed": True} if megatron_deepspeed else {}),
            "model": {"num_layers": model.config.num_layers, "hidden_size": model.config.hidden_size,
                      "vocab_size": model.config.vocab_size}}
    writer.save(save_dir, tag, plan, iteration=iteration, meta=meta, async_save=async_save,
                keep_last_k=keep_last_k, save_latest=save_latest)
    if async_save:  # the files are written from the live state: the next step must not change it before
        optimizer.before_next_step(writer.wait_until_state_read)
    return tag


def finalize_async_saves() -> None:
    """Wait for this rank's pending async save (rank 0: until it is committed). Call before exiting."""
    from .storage.writer import wait_for_pending_save
    wait_for_pending_save()
