#!/usr/bin/env python
"""Consolidate a ZeRO 1/2/3 checkpoint (DeepSpeed layout, any TP x PP x DP) into one fp32 state dict.

The standalone script copied, as `zero_to_fp32.py` (the name DeepSpeed users expect), into every
checkpoint megatron_zero writes, with safe_pickle.py beside it; needs only torch (no deepspeed, no
megatron_zero). The full tool, with safetensors output and --dtype, is tools/zero_to_fp32.py.

    python zero_to_fp32.py <checkpoint_dir> <output.pt> [--tag global_step100]

<checkpoint_dir> is the save directory (its `latest` names the tag) or a tag directory. For each
model-parallel rank the fp32 masters are reassembled from the DP partitions in the order of
`param_shapes`; then pipeline stages are merged by name and TP pieces joined as the checkpoint's
`universal_checkpoint_info` says (replicated: taken once; row-parallel: dim 1; others: dim 0, the
two halves of a SwiGLU [gate; up] each joined on their own; the vocabulary trimmed to
`original_vocab_size`). Shards are memory-mapped, not read whole, and unpickled safely (weights
only, plus safe_pickle.py's allow-list): a file referring to any other global is refused with a
sentence, and nothing in it runs.
"""
import argparse
import glob
import math
import os
import re
import sys
from collections import OrderedDict

import torch

try:  # beside this script in a checkpoint (else imported from the package)
    from safe_pickle import RefusedGlobal, safe_load
except ImportError:
    from megatron_zero.checkpoint.storage.safe_pickle import RefusedGlobal, safe_load


def _load(path):
    return safe_load(path, mmap=True, where=f"the checkpoint file {path}")


def _resolve(checkpoint_dir, tag=None):
    if tag is None and os.path.exists(os.path.join(checkpoint_dir, "latest")):
        with open(os.path.join(checkpoint_dir, "latest")) as f:
            tag = f.read().strip()
    path = os.path.join(checkpoint_dir, tag) if tag else checkpoint_dir
    if not os.path.isdir(path):
        raise FileNotFoundError(f"the checkpoint directory {path} does not exist")
    return path


def _optim_files(path, mp):
    files = glob.glob(os.path.join(path, f"*zero_pp_rank_*_mp_rank_{mp:02d}_optim_states.pt"))
    return sorted(files, key=lambda f: int(re.search(r"zero_pp_rank_(\d+)_", os.path.basename(f)).group(1)))


def _model_file(path, mp):
    for name in (f"mp_rank_{mp:02d}_model_states.pt", f"zero_pp_rank_0_mp_rank_{mp:02d}_model_states.pt"):
        if os.path.exists(os.path.join(path, name)):
            return os.path.join(path, name)
    raise FileNotFoundError(f"no model-states file for model-parallel rank {mp} in {path}")


def _merge_dp(path, mp):
    """name -> fp32 tensor (this model-parallel rank's local shapes), and the model-states dict."""
    states = _load(_model_file(path, mp))
    shapes = states["param_shapes"]
    files = _optim_files(path, mp)
    if not files:
        raise FileNotFoundError(f"no optimizer-state files for model-parallel rank {mp} in {path}")
    opts = [_load(f)["optimizer_state_dict"] for f in files]
    stage = opts[0]["zero_stage"]
    count = opts[0]["partition_count"]
    count = max(count) if isinstance(count, (list, tuple)) else count
    if count != len(files):
        raise ValueError(f"expected {count} optimizer-state files for model-parallel rank {mp} in {path}, "
                         f"found {len(files)}")
    out = OrderedDict()
    for g, group in enumerate(shapes):
        if stage <= 2:
            flat = torch.cat([o["single_partition_of_fp32_groups"][g].reshape(-1) for o in opts])
            offset = 0
            for name, shape in group.items():
                n = math.prod(shape)
                out[name] = flat[offset:offset + n].view(tuple(shape)).clone()
                offset += n
        else:
            flats = [o["fp32_flat_groups"][g].reshape(-1) for o in opts]
            offset = 0
            for name, shape in group.items():
                n = math.prod(shape)
                per = -(-n // count)
                out[name] = torch.cat([f[offset:offset + per] for f in flats])[:n].view(tuple(shape)).clone()
                offset += per
    for name, buf in (states.get("module") or {}).items():
        if name in states.get("buffer_names", []):
            out[name] = buf.float() if buf.is_floating_point() else buf
    return out, states


def _matches(patterns, name):
    return any(re.match(p, name) for p in patterns)


def get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag=None):
    path = _resolve(checkpoint_dir, tag)
    first = _load(_model_file(path, 0))
    mp_size = int(first.get("mp_world_size", 1) or 1)
    info = first.get("universal_checkpoint_info") or {}
    args = first.get("args")
    tp = (args.get if isinstance(args, dict) else lambda k, d: getattr(args, k, d))("tensor_model_parallel_size", 1)
    tp = int(tp or 1)
    pieces = OrderedDict()  # name -> [piece per TP rank]
    for mp in range(mp_size):
        sd, _ = _merge_dp(path, mp)
        tp_rank = mp % tp
        for name, t in sd.items():
            slot = pieces.setdefault(name, [None] * tp)
            if slot[tp_rank] is None:  # a pipeline-replicated copy (tied embedding) is taken once
                slot[tp_rank] = t
    out = OrderedDict()
    for name, parts in pieces.items():
        if tp == 1 or _matches(info.get("tp_replicated_parameter_patterns", []), name) or parts[0].dim() == 0:
            full = parts[0]
        else:
            dim = 1 if _matches(info.get("parameter_with_row_parallelism_patterns", []), name) else 0
            if _matches(info.get("parameter_with_2_sub_params_cat_dim_0", []), name):  # SwiGLU [gate; up]
                halves = [p.chunk(2, dim=0) for p in parts]
                parts = [h[0] for h in halves] + [h[1] for h in halves]
            full = torch.cat(parts, dim=dim)
        if _matches(info.get("vocabulary_parameter_patterns", []), name) and "original_vocab_size" in info:
            full = full[:info["original_vocab_size"]].clone()
        out[name] = full
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    parser.add_argument("checkpoint_dir")
    parser.add_argument("output_file")
    parser.add_argument("--tag", default=None)
    a = parser.parse_args()
    try:
        sd = get_fp32_state_dict_from_zero_checkpoint(a.checkpoint_dir, a.tag)
    except (RefusedGlobal, FileNotFoundError, ValueError) as e:
        print(f"zero_to_fp32.py: error: {e}", file=sys.stderr)
        return 2
    torch.save(sd, a.output_file)
    print(f"saved {len(sd)} fp32 tensors ({sum(t.numel() for t in sd.values())} elements) to {a.output_file}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
