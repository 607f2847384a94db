#!/usr/bin/env python
"""Consolidate a ZeRO 1/2/3 checkpoint (DeepSpeed layout, any TP x PP x DP) into one fp32 state dict.

The standalone script copied, as `zero_to_fp32.py` (the name DeepSpeed users expect), into every
checkpoint megatron_zero writes, with safe_pickle.py beside it; needs only torch (no deepspeed, no
megatron_zero). The full tool, with safetensors output and --dtype, is tools/zero_to_fp32.py.

    python zero_to_fp32.py <checkpoint_dir> <output.pt> [--tag global_step100] [--no-verify-checkpoint]

<checkpoint_dir> is the save directory (its `latest` names the tag) or a tag directory. For each
model-parallel rank the fp32 masters are reassembled from the DP partitions in the order of
`param_shapes`; then pipeline stages are merged by name and TP pieces joined as the checkpoint's
`universal_checkpoint_info` says (replicated: taken once; row-parallel: dim 1; others: dim 0, the
two halves of a SwiGLU [gate; up] each joined on their own; the vocabulary trimmed to
`original_vocab_size`). Shards are memory-mapped, not read whole, and unpickled safely (weights
only, plus safe_pickle.py's allow-list): a file referring to any other global is refused with a
sentence, and nothing in it runs. Before a file is read, its size and checksum are checked against
the checkpoint's manifest.json (as the package's reader does): a damaged, truncated or unlisted file
is refused with a sentence naming it. Checksums recorded as 'crc32' are computed with zlib; 'crc32c'
ones need the `crc32c` package (what megatron_zero installs): where it is missing the script says so
and stops, unless --no-verify-checkpoint is given. A directory without a manifest (DeepSpeed wrote
it) is read unverified, with a warning.
"""
import argparse
import glob
import json
import math
import os
import re
import sys
import zlib
from collections import OrderedDict

import torch

try:
    import crc32c as _crc32c
except ImportError:
    _crc32c = None

try:  # beside this script in a checkpoint (else imported from the package)
    from safe_pickle import RefusedGlobal, safe_load
except ImportError:
    from megatron_zero.checkpoint.storage.safe_pickle import RefusedGlobal, safe_load


MANIFEST = "manifest.json"
NO_VERIFY = "--no-verify-checkpoint"
_CHECKSUMS = {"crc32": zlib.crc32, "crc32c": _crc32c.crc32c if _crc32c is not None else None}


def _manifest_files(path, verify):
    """{relative name: {'size', 'checksum'}} of the tag directory's manifest; None: nothing to verify."""
    manifest_path = os.path.join(path, MANIFEST)
    if not verify:
        return None
    if not os.path.exists(manifest_path):
        print(f"zero_to_fp32.py: warning: {path} has no {MANIFEST} (not written by megatron_zero), so its "
              "files are read without checksum verification", file=sys.stderr)
        return None
    try:
        with open(manifest_path) as f:
            files = json.load(f)["files"]
        if not isinstance(files, dict):
            raise ValueError("its 'files' is not a mapping")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"the manifest {manifest_path} is damaged ({e}); pass {NO_VERIFY} to read the "
                         "checkpoint without it") from e
    return files


def _verify(path, files, root):
    """Check `path` against its manifest entry (size, then checksum); one sentence if it does not match."""
    name = os.path.relpath(path, root).replace(os.sep, "/")
    info = files.get(name)
    if not isinstance(info, dict) or "size" not in info or "checksum" not in info:
        raise ValueError(f"the checkpoint file {path} is not listed in {os.path.join(root, MANIFEST)}; refused")
    size = os.path.getsize(path)
    if size != info["size"]:
        raise ValueError(f"the checkpoint file {path} is {size} bytes but its manifest records {info['size']}: "
                         "it is truncated or damaged")
    algorithm, _, recorded = str(info["checksum"]).partition(":")
    if algorithm not in _CHECKSUMS:
        raise ValueError(f"the manifest records a checksum for {path} with the unknown algorithm {algorithm!r}; "
                         f"known: {', '.join(sorted(_CHECKSUMS))}")
    update = _CHECKSUMS[algorithm]
    if update is None:
        raise ValueError(f"verifying {path} against its {algorithm} checksum needs the `crc32c` package, which is "
                         f"not installed (pip install crc32c); or pass {NO_VERIFY} to convert without verification")
    value = 0
    with open(path, "rb", buffering=0) as f:
        for chunk in iter(lambda: f.read(8 << 20), b""):
            value = update(chunk, value)
    if f"{value:08x}" != recorded:
        raise ValueError(f"the checkpoint file {path} is damaged: its {algorithm} checksum is {value:08x} but "
                         f"the manifest records {recorded}; not converting")


class _Reader:
    """Loads the files of one tag directory, each checked against the manifest (when there is one) once."""

    def __init__(self, path, verify=True):
        self.path, self.files, self.verified = path, _manifest_files(path, verify), set()

    def load(self, file):
        if self.files is not None and file not in self.verified:
            _verify(file, self.files, self.path)
            self.verified.add(file)
        return safe_load(file, mmap=True, where=f"the checkpoint file {file}")


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


def _merge_dp(reader, mp):
    """name -> fp32 tensor (this model-parallel rank's local shapes), and the model-states dict."""
    path = reader.path
    states = reader.load(_model_file(path, mp))
    shapes = states["param_shapes"]
    files = _optim_files(path, mp)
    if not files:
        raise FileNotFoundError(f"no optimizer-state files for model-parallel rank {mp} in {path}")
    opts = [reader.load(f)["optimizer_state_dict"] for f in files]
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


def get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag=None, verify=True):
    path = _resolve(checkpoint_dir, tag)
    reader = _Reader(path, verify)
    first = reader.load(_model_file(path, 0))
    mp_size = int(first.get("mp_world_size", 1) or 1)
    info = first.get("universal_checkpoint_info") or {}
    args = first.get("args")
    tp = (args.get if isinstance(args, dict) else lambda k, d: getattr(args, k, d))("tensor_model_parallel_size", 1)
    tp = int(tp or 1)
    pieces = OrderedDict()  # name -> [piece per TP rank]
    for mp in range(mp_size):
        sd, _ = _merge_dp(reader, mp)
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
    parser.add_argument(NO_VERIFY, dest="verify", action="store_false",
                        help="read the files without checking them against the checkpoint's manifest")
    a = parser.parse_args()
    try:
        sd = get_fp32_state_dict_from_zero_checkpoint(a.checkpoint_dir, a.tag, verify=a.verify)
    except (RefusedGlobal, FileNotFoundError, ValueError) as e:
        print(f"zero_to_fp32.py: error: {e}", file=sys.stderr)
        return 2
    torch.save(sd, a.output_file)
    print(f"saved {len(sd)} fp32 tensors ({sum(t.numel() for t in sd.values())} elements) to {a.output_file}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
