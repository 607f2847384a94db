"""A Megatron-Core torch_dist checkpoint written as our (DeepSpeed's) universal checkpoint, one tensor at a time.

    summary = torch_dist_to_universal(src_dir, out_dir, vocab_size=None)

`<out>/zero/<name>/{fp32,exp_avg,exp_avg_sq,step}.pt` for every parameter (full, unpadded, with its split
dimension and sub-parameter count), `zero/optimizer_state.pt`, `mp_rank_00_model_states.pt` (Megatron-LM's
args, the iteration, `universal_checkpoint_info`), a manifest, and `<parent>/latest_universal`: what
`--load <out> --universal-checkpoint` reads at any layout. The model comes from the args in common.pt; the
vocabulary is `vocab_size` (the tokenizer's), or without it Megatron's padded size (padding rows kept).
Host memory: one layer's tensor at a time (each read is a one-layer slice of Megatron-Core's stacked tensor).
"""
from __future__ import annotations

import os
import shutil
import time
import uuid
from typing import Optional

import torch

from ...model.architecture import gpt_config, model_settings
from ...model.moe_layers import placement
from ...model.params import param_names, param_spec
from ..errors import CheckpointError
from ..format import LATEST_UNIVERSAL, STATE_KEYS, SUB_PARAMS_KEY, UNIVERSAL_CHECKPOINT_INFO
from ..progress import Progress
from ..storage.manifest import write_manifest
from ..storage.tensor_io import save_file
from .megatron_layout import TORCH_DIST, find_megatron_checkpoint
from .output_guard import check_output
from .torch_dist import TorchDistFiles, read_common


def config_from_common(common: dict, vocab_size: Optional[int], where: str):
    args = dict(vars(common["args"])) if hasattr(common.get("args"), "__dict__") else dict(common.get("args") or {})
    if not args.get("num_layers") or not args.get("hidden_size"):
        raise CheckpointError(f"{where}/common.pt records no Megatron-LM args (num_layers, hidden_size, ...), so "
                              "the model it holds is unknown; only checkpoints saved by Megatron-LM's training loop "
                              "can be converted")
    vocab = vocab_size or args.get("padded_vocab_size")
    if not vocab:
        raise CheckpointError(f"{where}/common.pt records no padded_vocab_size; pass --vocab-size")
    settings = {k: v for k, v in model_settings(args).items() if v is not None}
    if isinstance(args.get("moe_layer_freq"), (list, tuple)):
        settings.update(layer_pattern(list(args["moe_layer_freq"]), where))
    return gpt_config({**args, **settings}, int(vocab)), args


def layer_pattern(pattern: list, where: str) -> dict:
    """Megatron-LM's --moe-layer-freq as a list (1: an MoE layer) as our moe_layer_freq and moe_layer_offset."""
    try:
        freq, offset = placement(tuple(int(v) for v in pattern), len(pattern))
    except ValueError as e:
        raise CheckpointError(f"{where}/common.pt records {e}") from None
    return {"moe_layer_freq": freq, "moe_layer_offset": offset}


def torch_dist_to_universal(src: str, out: str, vocab_size: Optional[int] = None, force: bool = False) -> dict:
    found = find_megatron_checkpoint(src)
    if found is None or found[1] != TORCH_DIST:
        raise CheckpointError(f"{src} is not a Megatron-LM torch_dist checkpoint (an iter_XXXXXXX directory with "
                              ".metadata and common.pt, or a save directory naming one)")
    directory = found[0]
    common = read_common(directory)
    config, args = config_from_common(common, vocab_size, directory)
    files = TorchDistFiles(directory, config)
    head = files.model_states(0)  # Megatron-LM's header, with the routers' expert biases
    head[UNIVERSAL_CHECKPOINT_INFO] = {"original_vocab_size": config.vocab_size,
                                       "padded_vocab_size": args.get("padded_vocab_size")}
    summary = write_universal(files, config, head, out, directory, force)
    summary["source"] = directory
    return summary


def write_universal(files, config, head: dict, out: str, source: str, force: bool = False,
                    progress: bool = False) -> dict:
    """Any per-parameter source (`full`, `step`, `has_optimizer`) as a universal checkpoint with header `head`;
    refused where `<parent>/latest_universal` names a newer one (output_guard.py) unless `force`."""
    start = time.monotonic()
    out = os.path.normpath(out)
    if os.path.exists(out):
        raise CheckpointError(f"the output folder {out} already exists; choose a new one or remove it")
    check_output("universal", out, int(head.get("iteration", 0) or 0), force)
    names = param_names(config)
    numel = {n: torch.Size(param_spec(n, config).full_shape).numel() for n in names}
    bar = Progress("convert_checkpoint", 3 * len(names), progress, total_bytes=12 * sum(numel.values()))
    tmp = f"{out}.tmp-{uuid.uuid4().hex[:8]}"
    os.makedirs(os.path.join(tmp, "zero"))
    written, total = {}, 0

    def save(obj, rel):
        nonlocal total
        size, checksum = save_file(obj, os.path.join(tmp, rel), fsync=False)
        written[rel] = {"size": size, "checksum": checksum}
        total += size
        if isinstance(obj, dict) and "param" in obj:
            bar.update(1, size)

    try:
        keys = STATE_KEYS if files.has_optimizer else ("fp32",)
        for name in names:
            spec = param_spec(name, config)
            os.makedirs(os.path.join(tmp, "zero", name))
            for key in keys:
                full, _, sub = files.full(name, key)
                record = {"param": full}
                if spec.partition_dim is not None:
                    record["cat_dim"] = spec.partition_dim
                if spec.is_vocab:
                    record["vocab_tensor"] = True
                if sub > 1:
                    record[SUB_PARAMS_KEY] = sub
                save(record, f"zero/{name}/{key}.pt")
            if not files.has_optimizer:  # weights only: zero moments, as an import writes them
                zeros = {"param": torch.zeros(spec.full_shape), **({"cat_dim": spec.partition_dim}
                                                                   if spec.partition_dim is not None else {})}
                for key in ("exp_avg", "exp_avg_sq"):
                    save(zeros, f"zero/{name}/{key}.pt")
            save(torch.tensor(float(files.step(name))), f"zero/{name}/step.pt")
        save({"loss_scaler": None, "param_groups": []}, "zero/optimizer_state.pt")
        save(head, "mp_rank_00_model_states.pt")
        write_manifest(tmp, written, {"universal": True, "source": os.path.abspath(source),
                                      "iteration": head.get("iteration", 0)})
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        bar.close()
    root, name = os.path.split(out)
    with open(os.path.join(root or ".", LATEST_UNIVERSAL), "w") as f:
        f.write(name)
    return {"params": len(names), "bytes": total, "seconds": time.monotonic() - start, "tensors": bar.done,
            "iteration": head.get("iteration", 0)}
