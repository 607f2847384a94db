"""Consolidate any of our checkpoints (ZeRO 1/2/3 at any TP x PP x DP, or universal) into one fp32 state dict.

    consolidate_fp32("<save>", "<out>", safe_serialization=True, max_shard_size="2GB")
    sd = get_fp32_state_dict("<save>")               # in memory: {name: full fp32 tensor}

Names are the model's (Megatron-DeepSpeed's pipeline names), tensors in full form: TP slices
merged on each parameter's split dimension, DP fragments concatenated, the tied embedding
taken once, the vocabulary cut to its original size. Output: `pytorch_model.bin`, or
safetensors — `model.safetensors`, or `model-0000k-of-0000n.safetensors` shards plus
`model.safetensors.index.json` (Hugging Face's names). Parameters are assembled one at a
time from memory-mapped optimizer files and streamed out as they come, for both formats:
pytorch_model.bin through TorchZipWriter (torch.save's zip layout, data.pkl written last),
safetensors with the header written last into room reserved in front. Peak host memory is
about one parameter, never the model. A parameter that is a single fragment (a view of a
mapped file) is copied file-to-file in the kernel (copy_file_range) without passing through
this process. The model's persistent buffers (the routers' expert bias, checkpoint/model_buffers.py) follow the
parameters, as DeepSpeed's zero_to_fp32 adds them.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import struct
from typing import Dict, Iterator, List, Tuple

import torch
from safetensors.torch import load_file

from ..errors import CheckpointError
from ..format import LATEST
from ..storage.reader import open_directory
from ..storage.torch_zip_writer import TensorBytesWriter, TorchZipWriter, cpu_contiguous
from ..progress import Progress
from ..reshape.universal_convert import batches, param_numels
from ..model_buffers import saved_buffers
from ..reshape.universal_load import UniversalFiles, find_universal_dir, source_model_states
from ..reshape.universal_source import SourceCheckpoint

DTYPE_NAMES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
               torch.int64: "I64", torch.int32: "I32", torch.uint8: "U8", torch.bool: "BOOL"}


def parse_size(size) -> int:
    if isinstance(size, int):
        return size
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B)?\s*", str(size).upper())
    if not m:
        raise ValueError(f"max_shard_size {size!r} must be bytes or like '500MB' / '5GB'")
    unit = (m.group(2) or "B").replace("IB", "B")
    return int(float(m.group(1)) * {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}[unit])


def resolve_checkpoint_dir(path: str, tag: str = None) -> str:
    """A checkpoint directory from the save root (via `tag`, `latest` or `latest_universal`) or the directory itself."""
    if tag:
        return os.path.join(path, tag)
    universal = find_universal_dir(path)
    if universal is not None and not os.path.isfile(os.path.join(path, LATEST)):
        return universal
    latest = os.path.join(path, LATEST)
    if os.path.isfile(latest):
        with open(latest) as f:
            return os.path.join(path, f.read().strip())
    return path


def fp32_source(checkpoint_dir: str, progress: bool = False,
                verify: bool = True) -> Tuple[List[str], Iterator[Tuple[str, torch.Tensor]]]:
    """(every parameter's and persistent buffer's name, an iterator of (name, full fp32 tensor) one at a time),
    each file verified against the checkpoint's manifest as it is read (verify=False: unverified)."""
    universal = find_universal_dir(checkpoint_dir)
    if universal is not None:
        files = open_directory(universal, verify)
        zero = os.path.join(universal, "zero")
        names = sorted(d for d in os.listdir(zero) if os.path.isdir(os.path.join(zero, d)))
        buffers = saved_buffers(UniversalFiles(files).model_states)

        def from_universal():
            bar = Progress("zero_to_fp32", len(names), progress, unit="parameters")
            for name in names:
                t = files.load(f"zero/{name}/fp32.pt")["param"]
                bar.update(1, t.numel() * t.element_size())
                yield name, t
            bar.close()
            yield from buffers.items()
        return names + list(buffers), from_universal()
    src = SourceCheckpoint(checkpoint_dir, verify=verify)
    buffers = saved_buffers(lambda mp: source_model_states(src, mp))

    def from_zero():
        bar = Progress("zero_to_fp32", len(src.params), progress, unit="parameters",
                       total_bytes=4 * sum(param_numels(src).values()))
        for pp, names in batches(src):  # a fresh mapping per batch: touched pages are released after it
            with src.stage(pp) as reader:
                for name in names:
                    t, _ = reader.assemble(name, "fp32")
                    bar.update(1, t.numel() * t.element_size())
                    yield name, t
                if reader.mismatched:
                    raise CheckpointError(f"TP-replicated parameters differ across TP ranks in {checkpoint_dir}: "
                                          f"{', '.join(reader.mismatched)}")
        bar.close()
        yield from buffers.items()
    return [n for n, _ in src.params] + list(buffers), from_zero()


def iter_fp32(checkpoint_dir: str, progress: bool = False, verify: bool = True) -> Iterator[Tuple[str, torch.Tensor]]:
    """(name, full fp32 tensor) for every parameter, one at a time (views of the mapped files where possible)."""
    return fp32_source(checkpoint_dir, progress, verify)[1]


def get_fp32_state_dict(checkpoint_dir: str, tag: str = None, verify: bool = True) -> Dict[str, torch.Tensor]:
    """The whole consolidated state dict in memory (tensors copied out of the mapped files)."""
    return {n: t.clone() for n, t in iter_fp32(resolve_checkpoint_dir(checkpoint_dir, tag), verify=verify)}


def load_consolidated(path: str) -> Dict[str, torch.Tensor]:
    """A consolidated state dict from pytorch_model.bin, model.safetensors, or a sharded safetensors index."""
    if os.path.isdir(path):
        for name in ("model.safetensors.index.json", "model.safetensors", "pytorch_model.bin"):
            if os.path.isfile(os.path.join(path, name)):
                return load_consolidated(os.path.join(path, name))
        raise CheckpointError(f"{path} holds no pytorch_model.bin, model.safetensors or safetensors index")
    if path.endswith(".index.json"):
        with open(path) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        out = {}
        for shard in shards:
            out.update(load_file(os.path.join(os.path.dirname(path), shard)))
        return out
    if path.endswith(".safetensors"):
        return load_file(path)
    return torch.load(path, map_location="cpu", weights_only=True)


class SafetensorsStream:
    """One .safetensors file written tensor by tensor: the data first, after room reserved for the header
    (sized for `names`), then the header, padded with spaces as the format allows, in front."""

    def __init__(self, path: str, names: List[str], copy_files: bool = False):
        self.path, self.entries, self.offset = path, {}, 0
        reserve = 64 + sum(len(json.dumps(n)) + 48 + 10 * 21 for n in names)  # up to 10 dims, 20-digit numbers
        self.reserve = reserve + (-reserve % 8)
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.lseek(self.fd, 8 + self.reserve, os.SEEK_SET)
        self.out = TensorBytesWriter(self.fd, copy_files)

    def add(self, name: str, tensor: torch.Tensor) -> int:
        t = cpu_contiguous(tensor)
        n = self.out.write_tensor(t)
        self.entries[name] = {"dtype": DTYPE_NAMES[t.dtype], "shape": list(t.shape),
                              "data_offsets": [self.offset, self.offset + n]}
        self.offset += n
        return n

    def abort(self) -> None:
        self.out.close_sources()
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def close(self) -> None:
        self.out.close_sources()
        raw = json.dumps({**self.entries, "__metadata__": {"format": "pt"}}, separators=(",", ":")).encode()
        fd, self.fd = self.fd, None
        if len(raw) <= self.reserve:
            try:
                os.pwrite(fd, struct.pack("<Q", self.reserve) + raw + b" " * (self.reserve - len(raw)), 0)
            finally:
                os.close(fd)
            return
        os.close(fd)  # more dims than reserved for: write the header, then move the data behind it
        raw += b" " * (-len(raw) % 8)
        with open(self.path, "rb") as src, open(self.path + ".tmp", "wb") as dst:
            dst.write(struct.pack("<Q", len(raw)) + raw)
            src.seek(8 + self.reserve)
            shutil.copyfileobj(src, dst, 8 << 20)
        os.replace(self.path + ".tmp", self.path)


def consolidate_fp32(checkpoint_dir: str, output_dir: str, safe_serialization: bool = False,
                     max_shard_size="5GB", tag: str = None, progress: bool = True,
                     dtype: torch.dtype = torch.float32, verify: bool = True) -> dict:
    """Write the consolidated weights (fp32, or cast one parameter at a time to `dtype`), each file verified
    as it is read (verify=False: unverified); returns {'files', 'params', 'bytes'}."""
    directory = resolve_checkpoint_dir(checkpoint_dir, tag)
    os.makedirs(output_dir, exist_ok=True)
    names, tensors = fp32_source(directory, progress, verify)
    if dtype != torch.float32:
        tensors = ((name, t.to(dtype)) for name, t in tensors)
    # the tensors are views of read-only mapped files or fresh copies: their bytes are copied file-to-file
    if not safe_serialization:
        final = os.path.join(output_dir, "pytorch_model.bin")
        with TorchZipWriter(final + ".part", copy_files=True) as writer:
            total = sum(writer.add(name, t) for name, t in tensors)
        os.replace(final + ".part", final)
        return {"files": ["pytorch_model.bin"], "params": len(writer.entries), "bytes": total}
    return write_safetensors_shards(output_dir, names, tensors, max_shard_size, copy_files=True)


def write_safetensors_shards(output_dir: str, names: List[str], tensors: Iterator[Tuple[str, torch.Tensor]],
                             max_shard_size="5GB", copy_files: bool = False) -> dict:
    """Stream (name, tensor) pairs into `model.safetensors`, or into shards of at most `max_shard_size` with
    Hugging Face's `model.safetensors.index.json`; `names` lists them in stream order (it sizes the headers).
    Shards are written as `.part` files and renamed when all are complete. Returns {'files', 'params', 'bytes'}."""
    limit = parse_size(max_shard_size)
    shards: List[Tuple[str, List[str]]] = []
    shard, total, count = None, 0, 0
    try:
        for name, t in tensors:
            n = t.numel() * t.element_size()
            if shard is not None and shard.entries and shard.offset + n > limit:
                shard.close()
                shard = None
            if shard is None:
                part = os.path.join(output_dir, f"model-{len(shards) + 1:05d}.safetensors.part")
                shard = SafetensorsStream(part, names[count:], copy_files=copy_files)
                shards.append((part, []))
            shard.add(name, t)
            shards[-1][1].append(name)
            total += n
            count += 1
        if shard is not None:
            shard.close()
    except BaseException:
        if shard is not None:
            shard.abort()
        for part, _ in shards:
            if os.path.exists(part):
                os.remove(part)
        raise
    files, weight_map = [], {}
    for k, (part, members) in enumerate(shards):
        final = "model.safetensors" if len(shards) == 1 else f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        os.replace(part, os.path.join(output_dir, final))
        files.append(final)
        weight_map.update({n: final for n in members})
    if len(shards) > 1:
        with open(os.path.join(output_dir, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
        files.append("model.safetensors.index.json")
    return {"files": files, "params": count, "bytes": total}
