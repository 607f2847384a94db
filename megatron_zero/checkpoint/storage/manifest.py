"""The manifest: every file of a checkpoint with its size and checksum, written last.

Each rank records the files it wrote in a part file `.part-rank<r>.json` inside the
temporary directory (or, failing, why in `.failed-rank<r>.json`, for an async save's rank 0);
rank 0 merges the parts into `manifest.json` just before the directory is renamed into place.
Readers check that every listed file exists with its size, and the checksum of each file they
read (reader.py, as the file is read).
"""
from __future__ import annotations

import glob
import json
import os
from typing import Dict, Optional

from ..errors import CheckpointError

MANIFEST = "manifest.json"
FORMAT = "megatron_zero-manifest-1"


def _write_json_atomic(path: str, obj) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def part_path(tmp_dir: str, rank: int) -> str:
    return os.path.join(tmp_dir, f".part-rank{rank:05d}.json")


def write_part(tmp_dir: str, rank: int, files: Dict[str, dict]) -> None:
    """Record this rank's files ({name: {'size', 'checksum'}}); the part's presence means 'rank done'."""
    _write_json_atomic(part_path(tmp_dir, rank), {"rank": rank, "files": files})


def parts_present(tmp_dir: str, world_size: int) -> bool:
    return all(os.path.exists(part_path(tmp_dir, r)) for r in range(world_size))


def failure_path(tmp_dir: str, rank: int) -> str:
    return os.path.join(tmp_dir, f".failed-rank{rank:05d}.json")


def write_failure(tmp_dir: str, rank: int, info: dict) -> None:
    """Record that this rank could not write its files (an async save's rank 0 polls for it): the
    file's presence is the signal, `info` ({'file', 'what', 'needed'}) its reason where the disk still
    takes it. Best effort, and never creates tmp_dir (rank 0 may have removed it already)."""
    path = failure_path(tmp_dir, rank)
    try:
        _write_json_atomic(path, info)
    except OSError:
        try:
            os.close(os.open(path, os.O_CREAT | os.O_WRONLY, 0o644))  # a name needs no data blocks
        except OSError:
            pass


def failed_ranks(tmp_dir: str, world_size: int) -> Dict[int, Optional[dict]]:
    """{rank: its recorded reason, or None where it could not record one} of the ranks that failed."""
    out = {}
    for r in range(world_size):
        path = failure_path(tmp_dir, r)
        if os.path.exists(path):
            try:
                with open(path) as f:
                    info = json.load(f)
                out[r] = info if isinstance(info, dict) and {"file", "what", "needed"} <= info.keys() else None
            except (OSError, ValueError):
                out[r] = None
    return out


def merge_parts(tmp_dir: str, world_size: int, meta: dict) -> dict:
    """Merge every rank's part into manifest.json (fsynced); remove the parts."""
    files = {}
    for r in range(world_size):
        path = part_path(tmp_dir, r)
        if not os.path.exists(path):
            raise CheckpointError(f"rank {r} did not finish writing its files into {tmp_dir}; not committing")
        with open(path) as f:
            for name, info in json.load(f)["files"].items():
                files[name] = dict(info, rank=r)
    manifest = write_manifest(tmp_dir, files, meta)
    for p in glob.glob(os.path.join(tmp_dir, ".part-rank*.json")):
        os.remove(p)
    return manifest


def write_manifest(directory: str, files: Dict[str, dict], meta: dict) -> dict:
    """Write `directory`/manifest.json (fsynced) listing `files` ({relative name: {'size', 'checksum'}})."""
    manifest = dict(meta, format=FORMAT, files=files)
    _write_json_atomic(os.path.join(directory, MANIFEST), manifest)
    return manifest


def read_manifest(ckpt_dir: str) -> Optional[dict]:
    """The manifest of `ckpt_dir`, or None when it has none (a checkpoint DeepSpeed wrote)."""
    path = os.path.join(ckpt_dir, MANIFEST)
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            manifest = json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"the manifest {path} is damaged ({e})") from e
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"the manifest {path} has format {manifest.get('format')!r}, expected {FORMAT!r}")
    return manifest


def verify_sizes(ckpt_dir: str, manifest: dict) -> None:
    """Every listed file exists with its recorded size (a stat each: cheap)."""
    for name, info in sorted(manifest["files"].items()):
        path = os.path.join(ckpt_dir, name)
        if not os.path.exists(path):
            raise CheckpointError(f"the checkpoint file {path} listed in its manifest is missing")
        size = os.path.getsize(path)
        if size != info["size"]:
            raise CheckpointError(f"the checkpoint file {path} is {size} bytes but its manifest records "
                                  f"{info['size']}: it is truncated or damaged")
