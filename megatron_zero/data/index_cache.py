"""Index arrays built once, cached on disk, shared by every rank.

With torch.distributed initialised, global rank 0 builds missing files while the
others wait at a barrier, then everyone memory-maps them. Without it (one process,
or independent jobs on one file system) a file lock makes concurrent builders
take turns. Files are written to a temporary name and renamed, and the
description file is written last, so a cache entry is complete or absent.
"""
from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
from typing import Callable, Dict, Sequence

import numpy as np

from .errors import DataError


def _dist():
    try:
        import torch.distributed as dist
    except ImportError:
        return None
    return dist if dist.is_available() and dist.is_initialized() else None


@contextlib.contextmanager
def _file_lock(path: str):
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _atomic_save(path: str, array: np.ndarray) -> None:
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=os.path.basename(path) + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            np.save(f, array, allow_pickle=False)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def _atomic_write_text(path: str, text: str) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def cached_arrays(cache_dir: str, base: str, description: str, names: Sequence[str],
                  build: Callable[[], Dict[str, np.ndarray]]) -> Dict[str, np.ndarray]:
    """Return arrays `names` from `{cache_dir}/{base}-{name}.npy`, building them if absent."""
    paths = {n: os.path.join(cache_dir, f"{base}-{n}.npy") for n in names}
    desc = os.path.join(cache_dir, f"{base}-description.txt")

    def complete() -> bool:
        return os.path.isfile(desc) and all(os.path.isfile(p) for p in paths.values())

    def build_if_missing() -> None:
        os.makedirs(cache_dir, exist_ok=True)
        with _file_lock(os.path.join(cache_dir, f"{base}.lock")):
            if complete():
                return
            arrays = build()
            for n, p in paths.items():
                _atomic_save(p, arrays[n])
            _atomic_write_text(desc, description)

    dist = _dist()
    if dist is None:
        build_if_missing()
    else:
        error = None
        if dist.get_rank() == 0:
            try:
                build_if_missing()
            except BaseException as e:  # still reach the barrier so the other ranks do not hang
                error = e
        dist.barrier()
        if error is not None:
            raise error
    if not complete():
        raise DataError(f"{desc} is missing after rank 0 built the index cache; is {cache_dir} on a file system shared by all ranks?")
    with open(desc) as f:
        if f.read() != description:
            raise DataError(f"{desc} describes a different dataset than the one being built (a hash collision or an edited cache).")
    return {n: np.load(p, mmap_mode="r", allow_pickle=False) for n, p in paths.items()}
