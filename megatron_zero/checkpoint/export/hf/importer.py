"""Hugging Face model directory -> a weights-only universal checkpoint that `--load` reads at any layout.

    summary = import_hf("<hf_dir>", "<ckpt>", tp=2, pp=2)

writes
    <ckpt>/zero/<param>/fp32.pt           {'param': full fp32 tensor, ['cat_dim'], ['vocab_tensor'],
                                           ['param_n_sub_params']}
    <ckpt>/zero/optimizer_state.pt        {} (no optimizer: the run starts with a fresh one)
    <ckpt>/mp_rank_00_model_states.pt     {'args': the model's flags, 'iteration': 0, 'weights_only': True,
                                           'module' / 'buffer_names': the persistent buffers the HF model holds too
                                           (the expert bias: checkpoint/model_buffers.py), ...}
    <ckpt>/megatron_flags.txt             the flags that build this model, one command line
    <ckpt>/tokenizer/                     tokenizer.json (+ its config) when the HF directory has one

Loading it with `--load <ckpt>` takes the weights only (Megatron's `--finetune` semantics: fresh
optimizer, iteration 0), whatever TP x PP x DP and ZeRO stage the run uses. One parameter at a time
is read, transformed and written: memory is about the largest parameter, never the model. The
output is written into `<ckpt>.tmp-<id>` and renamed into place when complete.
"""
from __future__ import annotations

import dataclasses
import os
import shlex
import shutil
import time
import uuid
from typing import Optional

from ....model.params import param_names, param_spec
from ...errors import CheckpointError
from ...format import SUB_PARAMS_KEY, model_states_name
from ...storage.manifest import write_manifest
from ...storage.tensor_io import save_file
from . import for_hf_config, mappings_for
from .reader import HFModelDir

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
FLAGS_FILE = "megatron_flags.txt"


def implied_flags(module, config, tp: int, pp: int, tokenizer_dir: Optional[str]) -> list:
    flags = module.flags(config) + (["--apply-layernorm-1p"] if config.apply_layernorm_1p else [])
    flags += ["--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp)]
    if tokenizer_dir:
        flags += ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", tokenizer_dir]
    return flags


def import_hf(input_dir: str, output_dir: str, tp: int = 1, pp: int = 1, apply_layernorm_1p: bool = False) -> dict:
    """Convert; returns {'architecture', 'params', 'bytes', 'seconds', 'flags'}. An architecture's optional
    `config_for_files(config, names)` sets what of its config the files decide (DeepSeek's MTP depths).
    `apply_layernorm_1p`: the checkpoint holds a zero-centred model (each norm weight stored as gamma - 1), to
    train with that flag."""
    start = time.monotonic()
    hf = HFModelDir(input_dir)
    module = for_hf_config(hf.config, os.path.join(input_dir, "config.json"))
    config = dataclasses.replace(module.config_from_hf(hf.config), apply_layernorm_1p=apply_layernorm_1p)
    if hasattr(module, "config_for_files"):
        config = module.config_for_files(config, hf.config, set(hf.names))
    try:
        config.check_tp(tp)
    except ValueError as e:
        raise CheckpointError(f"--tensor-model-parallel-size {tp}: {e}") from None
    if not 1 <= pp <= config.num_layers:
        raise CheckpointError(f"--pipeline-model-parallel-size {pp} must lie in 1..{config.num_layers} "
                              "(the model's layers)")
    output_dir = os.path.normpath(output_dir)
    if os.path.exists(output_dir):
        raise CheckpointError(f"the output directory {output_dir} already exists; choose a new one or remove it")
    mappings = mappings_for(module, config)
    names = param_names(config)
    missing = [n for n in names if n not in mappings]
    if missing:
        raise CheckpointError(f"the {module.HF_ARCHITECTURE} mapping gives no tensor for {', '.join(missing[:3])}")
    unused = hf.unused([h for m in mappings.values() for h in m.hf], module.SKIPPED_HF)
    if unused:
        raise CheckpointError(f"{input_dir} holds tensors a {module.HF_ARCHITECTURE} of this config.json does not "
                              f"have ({', '.join(unused[:3])}{', ...' if len(unused) > 3 else ''})")
    tmp = f"{output_dir}.tmp-{uuid.uuid4().hex[:8]}"
    total, files = 0, {}

    def write(obj, rel):  # every file in the manifest, so readers verify the import like any checkpoint
        size, checksum = save_file(obj, os.path.join(tmp, rel), fsync=False)
        files[rel] = {"size": size, "checksum": checksum}
        return size
    try:
        for name in names:
            full = mappings[name].to_ours([hf.get(h) for h in mappings[name].hf]).float()
            spec = param_spec(name, config)
            if tuple(full.shape) != spec.full_shape:
                raise CheckpointError(f"{input_dir}: {', '.join(mappings[name].hf)} give {name} the shape "
                                      f"{tuple(full.shape)}, but config.json implies {spec.full_shape}")
            record = {} if spec.partition_dim is None else {"cat_dim": spec.partition_dim}
            if spec.is_vocab:
                record["vocab_tensor"] = True
            if spec.sub_params > 1:
                record[SUB_PARAMS_KEY] = spec.sub_params
            record["param"] = full.contiguous()
            os.makedirs(os.path.join(tmp, "zero", name))
            total += write(record, f"zero/{name}/fp32.pt")
            del full, record
        params = set(names)  # the mapped names beyond the parameters are buffers (the expert bias), kept whole
        buffers = {n: m.to_ours([hf.get(h) for h in m.hf]).float().contiguous() for n, m in mappings.items()
                   if n not in params}
        tokenizer_dir = None
        if os.path.isfile(os.path.join(input_dir, "tokenizer.json")):
            tokenizer_dir = os.path.join(output_dir, "tokenizer")
            os.makedirs(os.path.join(tmp, "tokenizer"))
            for f in TOKENIZER_FILES:
                if os.path.isfile(os.path.join(input_dir, f)):
                    shutil.copyfile(os.path.join(input_dir, f), os.path.join(tmp, "tokenizer", f))
        flags = implied_flags(module, config, tp, pp, tokenizer_dir)
        args = {k: v for k, v in vars(config).items() if k != "params_dtype"}
        args.update(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                    tokenizer_type="HuggingFaceTokenizer" if tokenizer_dir else None, tokenizer_model=tokenizer_dir)
        write({}, "zero/optimizer_state.pt")
        write({"args": args, "iteration": 0, "weights_only": True, "hf_architecture": module.HF_ARCHITECTURE,
               "hf_config": hf.config, "megatron_flags": flags, "module": buffers, "buffer_names": list(buffers)},
              model_states_name(0, 1))
        write_manifest(tmp, files, {"universal": True, "source": os.path.abspath(input_dir), "iteration": 0})
        with open(os.path.join(tmp, FLAGS_FILE), "w") as f:
            f.write(shlex.join(flags) + "\n")
        os.rename(tmp, output_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        hf.close()
    return {"architecture": module.HF_ARCHITECTURE, "params": len(names), "bytes": total,
            "seconds": time.monotonic() - start, "flags": flags}
