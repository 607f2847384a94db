"""load_checkpoint: read only this rank's files, verified, and refuse mismatches with one sentence.

    client_state = load_checkpoint(load_dir, state, model, optimizer, load_optimizer=True)
    client_state = load_checkpoint(..., checkpoint=open_directory(tag_dir))   # a directory opened already

Each file is loaded straight onto the device its tensors go to (map_location): the layer files
onto the model's device, the optimizer file onto where the optimizer keeps its state (the
device, or the host under ZeRO-Offload), one file at a time, memory-mapped, so the host holds
no copy of the model (a GPU holds one file's tensors beside the state while it is copied in).

Returns None when load_dir holds no `latest` (a fresh start, as Megatron does). The client
state comes back with `rng_state` resolved to this rank's (format.rank_rng_state: the DP-indexed list
in the file, DP rank 0's entry where the saving run had fewer DP ranks) and `args` as a dict.
"""
from __future__ import annotations

import argparse
import os
from collections import OrderedDict
from typing import Optional

import torch

from ..distributed.device import HOST
from ..model.converters import NO_CONVERTERS, ModelConverters
from ..distributed.topology import ParallelState
from ..zero.universal_state import set_state_from_params
from .deepspeed_layout import EMBED_PREFIX, layer_of, param_shapes, persistent_buffers
from .errors import CheckpointError
from .expert_layout import expert_files, is_expert_param
from .megatron_deepspeed import client_from_megatron_deepspeed, is_megatron_deepspeed_client
from .model_buffers import refuse_unknown, restore_buffers
from .format import LATEST, layer_file_name, model_states_name, optim_states_name, rank_rng_state
from .storage.reader import Checkpoint, open_checkpoint

ENGINE_KEYS = {"module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "shared_params",
               "frozen_param_fragments", "data_sampler", "random_ltd", "skipped_steps", "global_steps",
               "global_samples", "dp_world_size", "mp_world_size", "ds_config", "ds_version",
               "universal_checkpoint_info"}
CONVERTER_NOTES = "model_converter_notes"  # the client's lines when a converter's state starts fresh (FP8's histories)


def _check_layout(ckpt: Checkpoint, states: dict, name: str, state: ParallelState, need_same_dp: bool):
    saved = ckpt.meta.get("layout") or {"dp": states.get("dp_world_size"), "mp": states.get("mp_world_size")}
    lay = state.layout
    here = {"tp": lay.tp, "pp": lay.pp, "dp": lay.dp, "cp": lay.cp, "ep": getattr(state, "ep_size", 1),
            "etp": getattr(state, "etp_size", None) or lay.tp}
    if "tp" in saved:
        saved = {"cp": 1, "ep": 1, "etp": saved["tp"], **saved}
        differs = [k for k in ("tp", "pp", "ep", "etp") + (("dp", "cp") if need_same_dp else ()) if saved[k] != here[k]]
        what = f"TP={saved['tp']} x PP={saved['pp']} x DP={saved['dp']}" + (
            f" x CP={saved['cp']}" if saved["cp"] > 1 else "") + (f" x EP={saved['ep']}" if saved["ep"] > 1 else "") + (
            f" x ETP={saved['etp']}" if saved["etp"] != saved["tp"] else "")
    else:
        differs = (["mp"] if saved["mp"] != lay.mp_size else []) + (["dp"] if need_same_dp and
                                                                    saved["dp"] != lay.dp_cp else [])
        what = f"model-parallel size {saved['mp']} and DP={saved['dp']}"
    if differs:
        raise CheckpointError(f"the checkpoint {ckpt.directory} was saved with {what} but this run is {lay}; "
                              "resume on the same layout, or convert it with tools/ds_to_universal.py and "
                              "load it with --universal-checkpoint")


def _check_shapes(saved_groups, model, optimizer, path: str):
    """The non-expert parameters against the file's param_shapes (it lists the experts of the rank that wrote
    it; each expert file's shapes are checked as it loads)."""
    named = dict(model.named_parameters())
    saved = OrderedDict((n, tuple(s)) for g in saved_groups for n, s in g.items() if not is_expert_param(n))
    mine = OrderedDict((n, tuple(s)) for g in param_shapes(optimizer, named) for n, s in g.items()
                       if not is_expert_param(n))
    diffs = [f"{n} {list(saved[n])} in the checkpoint vs {list(mine[n])} here" for n in mine
             if n in saved and saved[n] != mine[n]]
    diffs += [f"{n} missing from the checkpoint" for n in mine if n not in saved]
    diffs += [f"{n} not in this model" for n in saved if n not in mine]
    if diffs:
        shown = "; ".join(diffs[:12]) + (f"; and {len(diffs) - 12} more" if len(diffs) > 12 else "")
        raise CheckpointError(f"the checkpoint file {path} holds a model of another shape ({len(diffs)} "
                              f"parameters differ: {shown}); build the model with the checkpoint's arguments")


def _load_experts(ckpt: Checkpoint, model, mp_rank: int, device: torch.device, sd: OrderedDict):
    """This rank's experts from their DeepSpeed-MoE files into `sd`, shapes checked."""
    mine = OrderedDict((k, v) for k, v in model.state_dict().items() if is_expert_param(k))
    for name, tensors in expert_files(mine, model.config, mp_rank).items():
        ckpt.require(name, "an expert of this rank")
        for k, v in ckpt.load(name, device=device).items():
            if k in tensors and tuple(v.shape) != tuple(tensors[k].shape):
                raise CheckpointError(f"the checkpoint file {ckpt.path(name)} holds {k} of shape {list(v.shape)}, "
                                      f"this model {list(tensors[k].shape)}; build the model with the "
                                      "checkpoint's arguments")
            if k in tensors:
                sd[k] = v


def _load_layers(ckpt: Checkpoint, model, tp_rank: int, device: torch.device, mp_rank: int = 0):
    """`mp_rank`: the model-parallel index of this rank's expert slices (pp x ETP + etp)."""
    indices = list(model.layer_indices)
    if (hasattr(model, "tied_modules") or "1" in model._modules) and 1 not in indices:
        indices = [1] + indices  # a last stage's copy of the tied (or, with MTP, untied) embedding: from layer_01
    sd = OrderedDict()
    for i in indices:
        name = layer_file_name(i, tp_rank)
        if not ckpt.has(name):
            continue  # layers without parameters have no file; a missing real one is caught below
        prefix = EMBED_PREFIX if i == 1 and hasattr(model, "tied_modules") else f"{i}."
        for k, v in ckpt.load(name, device=device).items():
            sd[prefix + k] = v
    if model.config.num_experts is not None:
        _load_experts(ckpt, model, mp_rank, device, sd)
    buffers = persistent_buffers(model)  # one the checkpoint lacks keeps its value (model_buffers.py)
    sd.update((k, v) for k, v in buffers.items() if k not in sd)
    names = set(model.state_dict())  # the parameters' shapes are checked: what else is there is saved state
    extra = [k for k in sd if k not in names]
    if extra:
        refuse_unknown(extra, ckpt.path(layer_file_name(layer_of(extra[0])[0], tp_rank)))
    missing = [k for k in model.state_dict() if k not in sd]
    if missing:
        files = sorted({layer_file_name(layer_of(k)[0], tp_rank) for k in missing})
        raise CheckpointError(f"the checkpoint file {ckpt.path(files[0])} is missing (it holds {missing[0]}"
                              f"{f' and {len(missing) - 1} more parameters' if len(missing) > 1 else ''})")
    model.load_state_dict(sd, strict=True)


def _check_decoupled_group(osd: dict, optimizer, directory: str) -> None:
    """A ZeRO file holds its param groups' partitions in order: one saved with(out) --decoupled-lr's group of the
    embedding and output layer loads only into a run with(out) it (the same sentence on every rank it concerns)."""
    base = osd.get("base_optimizer_state") or osd.get("optimizer_state_dict") or {}
    saved_groups = base.get("param_groups") or []
    saved = any(g.get("is_decoupled_lr") for g in saved_groups)
    ours = any(g.get("is_decoupled_lr") for g in optimizer.param_groups)
    if saved_groups and saved != ours:
        raise CheckpointError(f"the checkpoint {directory} was saved {'with' if saved else 'without'} --decoupled-lr "
                              f"and this run is {'with' if ours else 'without'} it; --decoupled-lr puts the embedding "
                              "and output layer in a param group of their own, so the run that changes it resumes "
                              "through tools/ds_to_universal.py and --universal-checkpoint, which regroup exactly")


def _weights_only(osd: dict) -> dict:
    """An optimizer state with the fp32 masters but fresh moments and step (--no-load-optim)."""
    sd = dict(osd)
    for key in ("base_optimizer_state", "optimizer_state_dict"):
        if key in sd:
            sd[key] = {"state": {}, "param_groups": []}
    sd["loss_scaler"] = None
    return sd


def _masters_from_weights(model, optimizer) -> None:
    """The ZeRO masters (this rank's fragments) from the weights just loaded, moments and step zero, as a
    weights-only load through reshape/ sets them: else the first step writes the initial weights back."""
    params = dict(model.named_parameters())

    def weights(name):
        fp32 = params[name].detach().float()
        return {"fp32": fp32, "exp_avg": torch.zeros_like(fp32), "exp_avg_sq": torch.zeros_like(fp32)}
    set_state_from_params(optimizer, weights, 0)


def state_devices(model, optimizer, device: Optional[torch.device] = None):
    """(where the model's tensors go, where the optimizer's state goes): `device` (default: the model's)
    and, under ZeRO-Offload, the host for the optimizer."""
    device = device if device is not None else next(model.parameters()).device
    return device, HOST if optimizer.offload != "none" else device


def load_checkpoint(load_dir: str, state: ParallelState, model, optimizer, load_optimizer: bool = True,
                    tag: Optional[str] = None, verify: bool = True, device: Optional[torch.device] = None,
                    checkpoint: Optional[Checkpoint] = None,
                    converters: ModelConverters = NO_CONVERTERS) -> Optional[dict]:
    """`checkpoint`: the directory already opened (resume_checkpoint passes the one it chose; load_dir and
    tag are then not read). A universal checkpoint, or one of another layout, is reshape/universal_load.py's.
    `converters`: the run's model converters (model/converters.py); they restore their entries of the model-states
    file (their training state: FP8 delayed scaling's histories)."""
    if checkpoint is None and tag is None and not os.path.exists(os.path.join(load_dir, LATEST)):
        return None
    ckpt = checkpoint if checkpoint is not None else open_checkpoint(load_dir, tag, verify=verify)
    stage, mp, dp = optimizer.stage, state.mp_rank, state.dp_rank
    ms_name = model_states_name(mp, stage, dp)
    if not ckpt.has(ms_name):
        other = model_states_name(mp, 0 if stage == 3 else 3, dp)
        why = (f"it was saved at ZeRO-{'3' if stage < 3 else '1/2'}, this run is ZeRO-{stage}" if ckpt.has(other)
               else f"needed by model-parallel rank {mp}")
        ckpt.require(ms_name, why)
    model_device, optimizer_device = state_devices(model, optimizer, device)
    states = ckpt.load(ms_name)  # the client state: on the host
    _check_layout(ckpt, states, ms_name, state, need_same_dp=load_optimizer or stage == 3)
    _check_shapes(states["param_shapes"], model, optimizer, ckpt.path(ms_name))
    if stage < 3:
        _load_layers(ckpt, model, state.tp_rank, model_device, getattr(state, "expert_mp_rank", mp))
    else:  # the buffers (the routers' expert bias) from this rank's model-states file
        restore_buffers(model, states.get("module"), ckpt.path(ms_name))
    bf16 = optimizer.dtype == torch.bfloat16
    opt_name = optim_states_name(dp, mp, bf16)
    if not ckpt.has(opt_name) and ckpt.has(optim_states_name(dp, mp, not bf16)):
        opt_name = optim_states_name(dp, mp, not bf16)
    saved = ckpt.meta.get("layout", {})
    saved_dp = saved["dp"] * saved.get("cp", 1) if "dp" in saved else states.get("dp_world_size")
    masters_loaded = load_optimizer or stage == 3 or saved_dp == state.dp_size
    if masters_loaded:
        ckpt.require(opt_name, f"the ZeRO state of DP rank {dp}, model-parallel rank {mp}")
        osd = ckpt.load(opt_name, device=optimizer_device)["optimizer_state_dict"]
        _check_decoupled_group(osd, optimizer, ckpt.directory)
        try:
            optimizer.load_state_dict(osd if load_optimizer else _weights_only(osd))
        except ValueError as e:
            raise CheckpointError(f"the checkpoint file {ckpt.path(opt_name)} does not fit this optimizer: {e}") from e
    else:  # weights only, saved at another DP: this rank's ZeRO partition is none of the saved ones
        _masters_from_weights(model, optimizer)
    client = {k: v for k, v in states.items() if k not in ENGINE_KEYS and k not in converters.state_keys}
    notes = converters.load_state_dict(model, states, optimizer)  # the same layout: bit-exact
    if notes:
        client[CONVERTER_NOTES] = notes
    client["lr_scheduler"] = states.get("lr_scheduler")
    client["rng_state"] = rank_rng_state(client.get("rng_state"), dp)
    if isinstance(client.get("args"), argparse.Namespace):
        client["args"] = vars(client["args"])
    return client_from_megatron_deepspeed(client) if is_megatron_deepspeed_client(client) else client
