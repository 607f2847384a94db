"""A consolidated 16-bit model next to each checkpoint (DeepSpeed's stage3_gather_16bit_weights_on_model_save).

With `--save-16bit-model` (or that DeepSpeed key), every save is followed by

    <save>/global_stepN/model_16bit/model-0000k-of-0000n.safetensors    one shard per rank that owns parameters
    <save>/global_stepN/model_16bit/model.safetensors.index.json        Hugging Face's index (rank 0, last)

(a single `model.safetensors` when one rank owns them all). Names and full shapes are those of
tools/zero_to_fp32.py (TP slices merged, tied embedding once, vocabulary cut to its size). Nothing
is gathered over the network and no host holds the model: once the checkpoint is committed, the
parameters are split across all ranks in contiguous runs of about equal bytes, and each rank
streams its run out of the just-written (memory-mapped) files, one parameter at a time, cast to
bf16/fp16. Every rank must see the checkpoint directory (a shared file system, as for loading).
A crash leaves `.part` files and no index; the index appears only when every shard is in place.
"""
from __future__ import annotations

import json
import os
from typing import List

import torch
import torch.distributed as dist

from .consolidate import SafetensorsStream
from ..reshape.universal_convert import param_numels
from ..reshape.universal_source import SourceCheckpoint

DIRNAME = "model_16bit"
INDEX = "model.safetensors.index.json"


def split_by_bytes(sizes: List[int], parts: int) -> List[range]:
    """`parts` contiguous index ranges of `sizes`, each about sum/parts (a range may be empty)."""
    total, bounds, acc, k = sum(sizes), [0], 0, 1
    for i, n in enumerate(sizes):
        acc += n
        while k < parts and acc >= total * k / parts:
            bounds.append(i + 1)
            k += 1
    bounds += [len(sizes)] * (parts + 1 - len(bounds))
    return [range(bounds[j], bounds[j + 1]) for j in range(parts)]


def shard_names(owned: List[range]) -> List[str]:
    """File name of each rank's shard ('' for a rank that owns nothing)."""
    count = sum(1 for r in owned if len(r))
    names, k = [], 0
    for r in owned:
        if not len(r):
            names.append("")
            continue
        k += 1
        names.append("model.safetensors" if count == 1 else f"model-{k:05d}-of-{count:05d}.safetensors")
    return names


def write_16bit_shard(checkpoint_dir: str, rank: int, world_size: int, dtype: torch.dtype) -> dict:
    """Write this rank's shard of the consolidated model; returns ({name: file}, tensor bytes) of what it wrote."""
    src = SourceCheckpoint(checkpoint_dir)
    numels = param_numels(src)
    order = [name for name, _ in src.params]
    owned = split_by_bytes([numels[n] for n in order], world_size)
    mine, filename = [order[i] for i in owned[rank]], shard_names(owned)[rank]
    if not mine:
        return {}, 0
    out_dir = os.path.join(checkpoint_dir, DIRNAME)
    os.makedirs(out_dir, exist_ok=True)
    part = os.path.join(out_dir, filename + ".part")
    stream = SafetensorsStream(part, mine)
    wanted = set(mine)
    stages = sorted({pp for name, pp in src.params if name in wanted})
    try:
        for pp in stages:
            with src.stage(pp) as reader:
                for name, stage in src.params:
                    if stage == pp and name in wanted:
                        stream.add(name, reader.assemble(name, "fp32")[0].to(dtype))
        stream.close()
    except BaseException:
        stream.abort()
        os.remove(part)
        raise
    os.replace(part, os.path.join(out_dir, filename))
    return {name: filename for name in mine}, stream.offset


def save_16bit_model(checkpoint_dir: str, dtype: torch.dtype) -> str:
    """Collective over the default group, after the checkpoint in `checkpoint_dir` is committed."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    if world > 1:
        dist.barrier()  # rank 0 returns from a save only once it has committed it
    written = write_16bit_shard(checkpoint_dir, rank, world, dtype)
    every = [written]
    if world > 1:
        every = [None] * world
        dist.all_gather_object(every, written)  # names and sizes only: a few KB
    out_dir = os.path.join(checkpoint_dir, DIRNAME)
    merged = {k: v for m, _ in every for k, v in m.items()}
    if rank == 0 and len(set(merged.values())) > 1:
        total = sum(n for _, n in every)
        tmp = os.path.join(out_dir, INDEX + ".part")
        with open(tmp, "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": merged}, f, indent=2)
        os.replace(tmp, os.path.join(out_dir, INDEX))
    if world > 1:
        dist.barrier()
    return out_dir
