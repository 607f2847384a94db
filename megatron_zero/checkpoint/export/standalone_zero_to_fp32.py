#!/usr/bin/env python
"""Consolidate a ZeRO 1/2/3 checkpoint (DeepSpeed layout, any TP x PP x DP) into one fp32 state dict.

The standalone script copied, as `zero_to_fp32.py` (the name DeepSpeed users expect), into every
checkpoint megatron_zero writes, with safe_pickle.py beside it; needs only torch (no deepspeed, no
megatron_zero; the `safetensors` package only for --safe_serialization). It takes DeepSpeed's command line
(tools/zero_to_fp32.py, the package's tool, takes the same and streams larger models):

    python zero_to_fp32.py <checkpoint_dir> <output_dir> [-t global_step100] [--safe_serialization]
                           [--max_shard_size 5GB] [--dtype fp32|bf16|fp16] [--quiet] [--no-verify-checkpoint]
    python zero_to_fp32.py <checkpoint_dir> <output.pt>      (DeepSpeed's older form: one file)

An output directory gets Hugging Face's names: pytorch_model.bin or model.safetensors, or shards of at most
--max_shard_size (`pytorch_model-00001-of-00002.bin`, `model-00001-of-00002.safetensors`) with
`pytorch_model.bin.index.json` / `model.safetensors.index.json`. An output ending in .pt, .pth, .bin or
.safetensors is one file (safetensors with --safe_serialization). --dtype casts the floating-point tensors.

<checkpoint_dir> is the save directory (its `latest` names the tag) or a tag directory. For each
model-parallel rank the fp32 masters are reassembled from the DP partitions in the order of
`param_shapes`; then pipeline stages are merged by name and TP pieces joined as the checkpoint's
`universal_checkpoint_info` says (replicated: taken once, as are the persistent buffers, whole on every
rank; row-parallel: dim 1; others: dim 0, the two halves of a SwiGLU [gate; up] each joined on their own; the
vocabulary trimmed to `original_vocab_size`). An MoE checkpoint's expert groups (partitioned over expert-DP, each EP rank its
own experts) give every expert under its global id. Shards are memory-mapped, not read whole, and unpickled safely (weights
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


# a block's expert, or a multi-token prediction depth's (`{L+4}.{k}.transformer_layer.mlp...`)
_EXPERT = re.compile(r"^(\d+\.(?:\d+\.transformer_layer\.)?mlp\.deepspeed_moe\.experts\.deepspeed_experts\.)(\d+)(\..+)$")


def _expert_count(path):
    """The experts of an MoE checkpoint: the global ids its layer_*_expert_* files name."""
    return len({m.group(1) for m in (re.match(r"^layer_\d+_expert_(\d+)_mp_rank_\d+_model_states\.pt$", f)
                                     for f in os.listdir(path)) if m})


def _merge_expert_group(opts, g, group, ep, experts, stage):
    """An expert group of an expert-parallel checkpoint: DP rank d holds EP rank d % ep's experts (global ids
    shifted by (d % ep) x experts / ep from those of `group`, which DP rank 0 listed), partitioned over the
    DP ranks d, d + ep, ...: at stage 1/2 each EP rank's flat is those partitions concatenated; at stage 3
    each parameter is cut into chunks of ceil(numel / expert-DP), one per rank, in order."""
    out = OrderedDict()
    for e in range(ep):
        ranks = range(e, len(opts), ep)
        if stage <= 2:
            flat = torch.cat([opts[d]["single_partition_of_fp32_groups"][g].reshape(-1) for d in ranks])
        else:
            flats = [opts[d]["fp32_flat_groups"][g].reshape(-1) for d in ranks]
        offset = 0
        for name, shape in group.items():
            m = _EXPERT.match(name)
            if m is None:
                raise ValueError(f"the optimizer group {g} is partitioned over {len(opts) // ep} of {len(opts)} "
                                 f"DP ranks (expert parallelism) but holds {name}, which is no expert")
            n = math.prod(shape)
            name = f"{m.group(1)}{int(m.group(2)) + e * experts // ep}{m.group(3)}"
            if stage <= 2:
                out[name] = flat[offset:offset + n].view(tuple(shape)).clone()
                offset += n
            else:
                per = -(-n // len(flats))
                out[name] = torch.cat([f[offset:offset + per] for f in flats])[:n].view(tuple(shape)).clone()
                offset += per
    return out


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
    counts = opts[0]["partition_count"] if isinstance(opts[0]["partition_count"], (list, tuple)) else None
    for g, group in enumerate(shapes):
        if counts is not None and counts[g] < len(opts):  # experts, over expert-DP (see below)
            out.update(_merge_expert_group(opts, g, group, len(opts) // counts[g], _expert_count(path), stage))
        elif stage <= 2:
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
    etp = (args.get if isinstance(args, dict) else lambda k, d: getattr(args, k, d))("expert_tensor_parallel_size", None)
    if etp not in (None, tp):
        raise ValueError(f"{path} was saved at --expert-tensor-parallel-size {etp}, not the tensor-parallel size {tp}; "
                         "consolidate it with megatron_zero's tools/zero_to_fp32.py, which merges expert slices by it")
    pieces = OrderedDict()  # name -> [piece per TP rank]
    for mp in range(mp_size):
        sd, _ = _merge_dp(reader, mp)
        tp_rank = mp % tp
        for name, t in sd.items():
            slot = pieces.setdefault(name, [None] * tp)
            if slot[tp_rank] is None:  # a pipeline-replicated copy (tied embedding) is taken once
                slot[tp_rank] = t
    out = OrderedDict()
    buffers = set(first.get("buffer_names") or ())  # whole on every rank (the routers' expert bias)
    for name, parts in pieces.items():
        if tp == 1 or name in buffers or _matches(info.get("tp_replicated_parameter_patterns", []), name) \
                or parts[0].dim() == 0:
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


DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
          "fp16": torch.float16, "float16": torch.float16}
FILE_SUFFIXES = (".pt", ".pth", ".bin", ".safetensors")
UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_size(text):
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]I?B|B)?\s*", str(text).upper())
    if not m:
        raise ValueError(f"--max_shard_size {text!r} must be a number of bytes or like 500MB / 5GB")
    return int(float(m.group(1)) * UNITS[m.group(2) or "B"])


def _save(tensors, path, safe):
    if safe:
        from safetensors.torch import save_file
        save_file({k: t.contiguous() for k, t in tensors.items()}, path, metadata={"format": "pt"})
    else:
        torch.save(tensors, path)


def write_state_dict(sd, output, safe=False, max_shard_size=None):
    """Write `sd` as one file (output ends in a file suffix) or into the directory `output` with Hugging Face's
    names, sharded at max_shard_size (default 5GB); returns the files written."""
    if output.endswith(FILE_SUFFIXES) and not os.path.isdir(output):
        if max_shard_size is not None:
            raise ValueError(f"--max_shard_size shards into an output directory, but {output} names one file; "
                             "give a directory instead")
        _save(sd, output, safe)
        return [output]
    limit = parse_size("5GB" if max_shard_size is None else max_shard_size)
    shards, size = [[]], 0
    for name, t in sd.items():
        n = t.numel() * t.element_size()
        if shards[-1] and size + n > limit:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += n
    os.makedirs(output, exist_ok=True)
    stem, ext = ("model", ".safetensors") if safe else ("pytorch_model", ".bin")
    names = [f"{stem}{ext}"] if len(shards) == 1 else \
        [f"{stem}-{k + 1:05d}-of-{len(shards):05d}{ext}" for k in range(len(shards))]
    for file, members in zip(names, shards):
        _save(OrderedDict((m, sd[m]) for m in members), os.path.join(output, file), safe)
    if len(shards) == 1:
        return names
    index = f"{stem}{ext}.index.json"
    with open(os.path.join(output, index), "w") as f:
        json.dump({"metadata": {"total_size": sum(t.numel() * t.element_size() for t in sd.values())},
                   "weight_map": {m: file for file, members in zip(names, shards) for m in members}}, f, indent=2)
    return names + [index]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    parser.add_argument("checkpoint_dir", help="the save directory (its `latest` names the tag) or a tag directory")
    parser.add_argument("output_dir", help="a directory for the consolidated files (Hugging Face's names), or a "
                        "file name ending in .pt, .pth, .bin or .safetensors")
    parser.add_argument("-t", "--tag", default=None, help="checkpoint tag, e.g. global_step100 (default: `latest`)")
    parser.add_argument("--safe_serialization", action="store_true",
                        help="write safetensors (needs the safetensors package) instead of torch.save's format")
    parser.add_argument("--max_shard_size", default=None,
                        help="largest file in an output directory, e.g. 500MB (default 5GB)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32",
                        help="cast the floating-point tensors to this type (bf16 / fp16: a 16-bit model)")
    parser.add_argument("--exclude_frozen_parameters", action="store_true",
                        help="DeepSpeed's flag; megatron_zero checkpoints hold no frozen parameters to exclude")
    parser.add_argument("--quiet", action="store_true", help="print nothing when it succeeds")
    parser.add_argument(NO_VERIFY, dest="verify", action="store_false",
                        help="read the files without checking them against the checkpoint's manifest")
    a = parser.parse_args(argv)
    if a.safe_serialization:
        try:
            import safetensors.torch  # noqa: F401
        except ImportError:
            print("zero_to_fp32.py: error: --safe_serialization needs the safetensors package, which is not "
                  "installed (pip install safetensors); or leave the flag out for torch.save's format",
                  file=sys.stderr)
            return 2
    try:
        if a.max_shard_size is not None:
            parse_size(a.max_shard_size)
        sd = get_fp32_state_dict_from_zero_checkpoint(a.checkpoint_dir, a.tag, verify=a.verify)
        dtype = DTYPES[a.dtype]
        sd = OrderedDict((k, t.to(dtype) if t.is_floating_point() else t) for k, t in sd.items())
        files = write_state_dict(sd, a.output_dir, a.safe_serialization, a.max_shard_size)
    except (RefusedGlobal, FileNotFoundError, ValueError) as e:
        print(f"zero_to_fp32.py: error: {e}", file=sys.stderr)
        return 2
    if not a.quiet:
        where = a.output_dir if files == [a.output_dir] else f"{a.output_dir}: {', '.join(files)}"
        print(f"saved {len(sd)} {a.dtype} tensors ({sum(t.numel() for t in sd.values())} elements) to {where}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
