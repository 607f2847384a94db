"""Any of our checkpoints -> a Hugging Face model directory: config.json, generation_config.json and
model.safetensors (or shards of at most `max_shard_size` with model.safetensors.index.json).

    summary = export_hf("<save>", "<hf_dir>", dtype="bf16", max_shard_size="5GB")

Parameters stream out one at a time (consolidate.fp32_source: assembled from memory-mapped ZeRO
files, or read from a universal checkpoint), each turned into its Hugging Face tensors by the
architecture's mappings, cast to `dtype` and appended to the current shard (consolidate's
SafetensorsStream: the `safetensors` library writes a file only from a complete dict in memory,
so a bounded-memory export needs our own writer; the files are the same format, read by
`safetensors` in the tests). Memory is about one parameter, never the model.
"""
from __future__ import annotations

import json
import os
import re
import shutil
from typing import Optional

import torch

from ..consolidate import fp32_source, resolve_checkpoint_dir, write_safetensors_shards
from ...errors import CheckpointError
from ...format import MODEL_FILE
from ...storage.reader import open_directory
from ...saved_config import saved_args, saved_config
from ...reshape.universal_load import find_universal_dir
from ....model.layer_indices import mtp_index
from . import for_config, mappings_for

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def shape_reader(directory: str, verify: bool = True):
    """(every parameter name, shape_of(name) -> full shape): a universal checkpoint's files are mapped one by
    one as asked; a ZeRO checkpoint's shapes come from one pass assembling each parameter."""
    universal = find_universal_dir(directory)
    if universal is not None:
        zero, files = os.path.join(universal, "zero"), open_directory(universal, verify)
        names = [n for n in os.listdir(zero) if os.path.isdir(os.path.join(zero, n))]
        return names, lambda n: tuple(files.load(f"zero/{n}/fp32.pt")["param"].shape)
    shapes = {n: tuple(t.shape) for n, t in fp32_source(directory, verify=verify)[1]}
    return list(shapes), shapes.__getitem__


def _head(directory: str, verify: bool = True) -> dict:
    files = [f for f in sorted(os.listdir(directory)) if MODEL_FILE.match(f)]
    return open_directory(directory, verify).load(files[0]) if files else {}


def export_hf(checkpoint_dir: str, output_dir: str, dtype: str = "fp32", max_shard_size="5GB",
              architecture: Optional[str] = None, num_heads: Optional[int] = None, tag: Optional[str] = None,
              progress: bool = False, verify: bool = True) -> dict:
    """Convert; returns {'architecture', 'config', 'files', 'params', 'bytes', 'dropped'}: `dropped` the
    parameters no Hugging Face model of the architecture holds (the multi-token prediction depths)."""
    if dtype not in DTYPES:
        raise CheckpointError(f"--dtype {dtype} is unknown; choose one of {', '.join(DTYPES)}")
    directory = resolve_checkpoint_dir(checkpoint_dir, tag)
    if not os.path.isdir(directory):
        raise CheckpointError(f"the checkpoint directory {directory} does not exist")
    config = saved_config(*shape_reader(directory, verify), saved_args(directory, verify), num_heads, where=directory)
    head = _head(directory, verify)
    module = for_config(config, architecture or head.get("hf_architecture"))
    mappings = mappings_for(module, config)
    names, tensors = fp32_source(directory, progress, verify)
    mtp = f"{mtp_index(config.num_layers)}."  # multi-token prediction's depths: no Hugging Face model holds them
    dropped = [n for n in names if n.startswith(mtp) and n not in mappings]
    names = [n for n in names if n not in dropped]
    unmapped = [n for n in names if n not in mappings]
    if unmapped or len(names) != len(mappings):
        raise CheckpointError(f"{directory} holds {len(names)} parameters, a {module.HF_ARCHITECTURE} of its config "
                              f"{len(mappings)}{': no mapping for ' + ', '.join(unmapped[:3]) if unmapped else ''}")
    cast = DTYPES[dtype]
    kept_fp32 = [re.compile(p) for p in getattr(module, "FP32_HF", ())]  # stored fp32 whatever --dtype says

    def hf_tensors():
        for name, full in tensors:
            if name in dropped:
                continue
            m = mappings[name]
            for hf_name, t in zip(m.hf, m.to_hf(full)):
                yield hf_name, t.to(torch.float32 if any(p.search(hf_name) for p in kept_fp32) else cast)

    os.makedirs(output_dir, exist_ok=True)
    for stale in ("model.safetensors", "model.safetensors.index.json"):
        if os.path.exists(os.path.join(output_dir, stale)):
            os.remove(os.path.join(output_dir, stale))
    hf_names = [h for n in names for h in mappings[n].hf]
    written = write_safetensors_shards(output_dir, hf_names, hf_tensors(), max_shard_size,
                                       copy_files=cast == torch.float32)
    hf = {**module.hf_config(config), "torch_dtype": str(cast).replace("torch.", "")}
    saved = head.get("hf_config") or {}
    tokens = {k: saved[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if saved.get(k) is not None}
    hf.update(tokens)
    hf.update({k: saved[k] for k in module.PRESERVED_HF if k in saved})
    with open(os.path.join(output_dir, "config.json"), "w") as f:
        json.dump(hf, f, indent=2)
    with open(os.path.join(output_dir, "generation_config.json"), "w") as f:
        json.dump({**tokens, "_from_model_config": True}, f, indent=2)
    tokenizer = os.path.join(directory, "tokenizer")  # an import's tokenizer goes back with the weights
    if os.path.isdir(tokenizer):
        for f in os.listdir(tokenizer):
            shutil.copyfile(os.path.join(tokenizer, f), os.path.join(output_dir, f))
    return {"architecture": module.HF_ARCHITECTURE, "config": config, "dropped": dropped, **written}
