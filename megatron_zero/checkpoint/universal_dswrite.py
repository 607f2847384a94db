"""A plain DeepSpeed-layout ZeRO checkpoint writer, for the universal-checkpoint tests and benchmarks.

    write_zero_checkpoint(save_dir, iteration, state, model, optimizer, client_state)

Every rank writes its `zero_pp_rank_{dp}_mp_rank_{mp:02d}_optim_states.pt`; DP rank 0 of each
model-parallel rank writes `mp_rank_{mp:02d}_model_states.pt` (param_shapes, the keys
DeepSpeed writes, `checkpoint_parallel_dimensions`, `universal_checkpoint_info`, the client
state) and, with pipelining, its `layer_{idx:02d}-model_{tp:02d}-model_states.pt` files.
This is the on-disk format of DESIGN.md without the commit protocol and manifest (those
belong to megatron_zero.checkpoint's save path); it lets the offline tools be tested on
real multi-rank checkpoints, and DeepSpeed's ds_to_universal reads what it writes.
"""
from __future__ import annotations

import os
from collections import OrderedDict

import torch
import torch.distributed as dist

from ..model.layers import EMBEDDING_INDEX, layer_kind
from ..zero.checkpoint_state import DS_VERSION
from .tensor_io import save_file
from .universal_info import UNIVERSAL_CHECKPOINT_INFO, gpt_universal_checkpoint_info


def param_shapes(model, optimizer):
    params = dict(model.named_parameters())
    out = []
    for names in optimizer.names:
        out.append(OrderedDict((n, getattr(params[n], "ds_shape", None) or params[n].shape) for n in names))
    return out


def _layer_files(model, tp_rank: int):
    sd = model.state_dict()
    files = {}
    for idx in model.layer_indices:
        kind = layer_kind(idx, model.config.num_layers)
        prefix = "tied_modules.embed." if kind == "embedding" else f"{idx}."
        if kind not in ("embedding", "block", "final_norm"):
            continue
        layer = OrderedDict((k[len(prefix):], v) for k, v in sd.items() if k.startswith(prefix))
        if layer:
            files[f"layer_{idx:02d}-model_{tp_rank:02d}-model_states.pt"] = layer
    if EMBEDDING_INDEX not in model.layer_indices:
        files = {k: v for k, v in files.items() if not k.startswith(f"layer_{EMBEDDING_INDEX:02d}-")}
    return files


def write_zero_checkpoint(save_dir: str, iteration: int, state, model, optimizer, client_state: dict,
                          ds_config: dict = None) -> str:
    tag = f"global_step{iteration}"
    directory = os.path.join(save_dir, tag)
    os.makedirs(directory, exist_ok=True)
    ds_config = ds_config or {"zero_optimization": {"stage": optimizer.stage}}
    mp, dp, tp = state.mp_rank, state.dp_rank, state.tp_rank
    osd = dict(optimizer.state_dict())
    if optimizer.stage in (1, 2) and isinstance(osd.get("partition_count"), int):
        # DeepSpeed's stage 1/2 writes one count per param group; its ds_to_universal needs the list
        osd["partition_count"] = [osd["partition_count"]] * len(optimizer.names)
    optim = {"optimizer_state_dict": osd, "ds_config": ds_config, "ds_version": DS_VERSION}
    save_file(optim, os.path.join(directory, f"zero_pp_rank_{dp}_mp_rank_{mp:02d}_optim_states.pt"), fsync=False)
    if dp == 0:
        cfg = model.config
        pipelined = state.pp_size > 1
        head = {
            "module": None if pipelined else model.state_dict(),
            "buffer_names": [], "param_shapes": param_shapes(model, optimizer), "shared_params": {},
            "frozen_param_shapes": None, "frozen_param_fragments": None,
            "global_steps": iteration, "global_samples": client_state.get("consumed_train_samples", 0),
            "dp_world_size": state.dp_size, "mp_world_size": state.tp_size, "ds_config": ds_config,
            "ds_version": DS_VERSION, "skipped_steps": 0, "lr_scheduler": client_state.get("lr_scheduler"),
            "checkpoint_parallel_dimensions": {"pp_degree": state.pp_size, "tp_degree": state.tp_size},
            UNIVERSAL_CHECKPOINT_INFO: gpt_universal_checkpoint_info(cfg.vocab_size, cfg.padded_vocab_size(state.tp_size)),
            "checkpoint_version": 3.0,
        }
        head.update(client_state)
        save_file(head, os.path.join(directory, f"mp_rank_{mp:02d}_model_states.pt"), fsync=False)
        if pipelined:
            for name, layer in _layer_files(model, tp).items():
                save_file(layer, os.path.join(directory, name), fsync=False)
    if dist.is_initialized():
        dist.barrier()
    if not dist.is_initialized() or dist.get_rank() == 0:
        with open(os.path.join(save_dir, "latest"), "w") as f:
            f.write(tag)
    return directory
