"""Write and read one checkpoint file: torch.save format, streamed, checksummed, fsynced.

`save_file` writes with `torch.save`'s zip format (so torch.load and DeepSpeed's tools
read it) but through a file object of our own that computes a checksum (checksum.py:
hardware CRC-32C) and writes each tensor's bytes straight from the tensor's memory, in
chunks: no second copy of the state is built in host RAM. torch's own per-record CRC is
switched off (our checksum covers the whole file, and torch.load does not check it).
Each chunk's write-back to disk is started at once (sync_file_range), so the disk works
while the next chunk is checksummed and the final fsync has little left to wait for.

Views: torch.save writes a tensor's *whole storage*, so saving a slice of a big flat
buffer would write the whole buffer. `tight_tensors` re-points every contiguous view at
exactly its own bytes without copying (torch.from_dlpack over the same memory, on the
CPU or a GPU alike); device tensors stay on the device, and torch.save copies them to the
host one storage at a time, so host memory during a save from a GPU is bounded by the
largest single tensor saved, not by the state;
`clone_tensors_for_torch_save` is DeepSpeed's copying equivalent, for users' own saves.
"""
from __future__ import annotations

import collections
import io
import os
import pickle
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any, Optional, Tuple

import torch
import torch.serialization

from .checksum import Checksum, algorithm_of
from ..errors import CheckpointError, crash_point
from .safe_pickle import RefusedGlobal, safe_load

CHUNK_BYTES = 8 << 20


def map_tensors(item, fn, memo=None):
    """`item` with every tensor t replaced by fn(t) (dicts, lists, tuples walked; shared tensors stay shared)."""
    memo = {} if memo is None else memo
    if torch.is_tensor(item):
        key = (item.data_ptr(), item.dtype, tuple(item.shape), tuple(item.stride()), item.device.type)
        if key not in memo:
            memo[key] = fn(item)
        return memo[key]
    if isinstance(item, dict):
        kind = type(item) if type(item) in (dict, collections.OrderedDict) else dict
        return kind((k, map_tensors(v, fn, memo)) for k, v in item.items())
    if type(item) in (list, tuple):  # not subclasses: torch.Size and named tuples stay what they are
        return type(item)(map_tensors(v, fn, memo) for v in item)
    return item


def _tight(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    nbytes = t.numel() * t.element_size()
    if t.is_contiguous() and t.storage_offset() == 0 and t.untyped_storage().nbytes() == nbytes:
        return t
    if not t.is_contiguous() or nbytes == 0:
        return t.clone()
    raw = torch.from_dlpack(t.reshape(-1).view(torch.uint8))  # shares t's memory, owns exactly its bytes
    return raw.view(t.dtype).view(t.shape)


def tight_tensors(item: Any) -> Any:
    """The same structure with every tensor detached, on its device, and owning exactly its bytes (no copy)."""
    return map_tensors(item, _tight, {})


def clone_tensors_for_torch_save(item: Any, device: torch.device = torch.device("cpu")) -> Any:
    """DeepSpeed's helper: copy every tensor (so torch.save writes only its bytes), keeping shared ones shared."""
    return map_tensors(item, lambda t: t.detach().clone().to(device), {})


def _sync_file_range():
    """Linux's sync_file_range(fd, offset, nbytes, SYNC_FILE_RANGE_WRITE) via ctypes, or None."""
    try:
        import ctypes
        import ctypes.util
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fn = libc.sync_file_range
        fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
        return lambda fd, off, n: fn(fd, off, n, 2)
    except (OSError, AttributeError):
        return None


_START_WRITEBACK = _sync_file_range()


class _ChecksumWriter:
    """The file object torch.save writes into: os.write in bounded chunks, the checksum alongside.

    A big write (a tensor) is cut into chunks; a helper thread checksums chunk i (the GIL is
    released) while this thread writes it, and write() returns only when both are done, so no
    buffer torch hands us is used after the call."""

    def __init__(self, path: str, rank: int):
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self.checksum, self.size, self.rank = Checksum(), 0, rank
        self.pool = ThreadPoolExecutor(max_workers=1)
        self.error: Optional[OSError] = None  # torch.save turns our exceptions into 'unexpected pos'

    def write(self, data) -> int:
        try:
            return self._write(data)
        except OSError as e:
            self.error = self.error or e
            raise

    def _update(self, chunk):
        self.checksum.update(chunk)

    def _write(self, data) -> int:
        mv = memoryview(data).cast("B")
        pending = None
        for off in range(0, len(mv), CHUNK_BYTES):
            chunk = mv[off:off + CHUNK_BYTES]
            if len(mv) > CHUNK_BYTES:
                pending = self.pool.submit(self._update, chunk)  # one worker: chunks checksummed in order
            else:
                self._update(chunk)
            done = 0
            while done < len(chunk):
                done += os.write(self.fd, chunk[done:])
            if _START_WRITEBACK is not None:  # the disk starts on this chunk at once
                _START_WRITEBACK(self.fd, self.size, len(chunk))
            self.size += len(chunk)
            if self.size > (1 << 16):
                crash_point("mid_file", self.rank)
        if pending is not None:
            pending.result()
        return len(mv)

    def flush(self):
        pass

    def close(self, fsync: bool = True):
        self.pool.shutdown(wait=True)
        if fsync:
            os.fsync(self.fd)
        os.close(self.fd)


@contextmanager
def _no_torch_crc():
    if not hasattr(torch.serialization, "set_crc32_options"):  # a torch before the switch: it computes CRCs
        yield
        return
    before = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(False)
    try:
        yield
    finally:
        torch.serialization.set_crc32_options(before)


def save_file(obj: Any, path: str, fsync: bool = True, rank: int = 0) -> Tuple[int, str]:
    """torch.save `obj` to `path` (tensors streamed from their memory); return (size, checksum string)."""
    obj = tight_tensors(obj)
    writer = _ChecksumWriter(path, rank)
    try:
        with _no_torch_crc():
            torch.save(obj, writer)
        writer.close(fsync=fsync)
    except (OSError, RuntimeError) as e:
        try:
            writer.close(fsync=False)
        except OSError:
            pass
        err = writer.error or e
        if not isinstance(err, OSError):
            raise
        raise OSError(err.errno, err.strerror, path) from e
    return writer.size, str(writer.checksum)


def _read_checksummed(path: str, keep: bool, algorithm: str) -> Tuple[str, Optional[bytearray]]:
    """One pass over the file: its checksum, and with keep=True its bytes."""
    checksum, size = Checksum(algorithm), os.path.getsize(path)
    data = bytearray(size) if keep else bytearray(min(size, CHUNK_BYTES) or 1)
    view, pos = memoryview(data), 0
    with open(path, "rb", buffering=0) as f:
        while True:
            chunk = view[pos:pos + CHUNK_BYTES] if keep else view
            n = f.readinto(chunk)
            if not n:
                break
            checksum.update(chunk[:n])
            pos += n if keep else 0
    if keep and pos != size:
        raise OSError(f"read {pos} bytes of {size}")
    return str(checksum), data if keep else None


def verify_file(path: str, checksum: str, keep: bool = False) -> Optional[bytearray]:
    """Refuse `path` unless its checksum is `checksum`; with keep=True return the bytes read."""
    got, data = _read_checksummed(path, keep, algorithm_of(checksum, path))
    if got != checksum:
        raise CheckpointError(f"the checkpoint file {path} fails its checksum ({got}, manifest records "
                              f"{checksum}): it is damaged")
    return data


def load_file(path: str, mmap: bool = True, checksum: Optional[str] = None) -> Any:
    """Safely load a checkpoint file onto the CPU (weights only + safe_pickle's allow-list).

    With `checksum` (the manifest's), the file is verified as it is read: mmap=False reads it
    once, checksumming each chunk, and unpickles those bytes; mmap=True checksums it in one
    sequential read that leaves its pages in the page cache, where the mapping then finds them.
    A legacy (non-zip) file, which cannot be mapped, is read without mapping."""
    if not os.path.exists(path):
        raise CheckpointError(f"the checkpoint file {path} is missing")
    try:
        data = verify_file(path, checksum, keep=not mmap) if checksum is not None else None
        try:
            return safe_load(io.BytesIO(data) if data is not None else path, mmap=mmap and data is None,
                             where=f"the checkpoint file {path}")
        except RuntimeError as e:
            if mmap and data is None and "mmap" in str(e):
                return safe_load(path, mmap=False, where=f"the checkpoint file {path}")
            raise
    except RefusedGlobal as e:
        raise CheckpointError(str(e)) from None
    except (RuntimeError, EOFError, OSError, ValueError, pickle.UnpicklingError) as e:
        if isinstance(e, CheckpointError):
            raise
        raise CheckpointError(f"the checkpoint file {path} cannot be read ({str(e).splitlines()[0]})") from e


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
