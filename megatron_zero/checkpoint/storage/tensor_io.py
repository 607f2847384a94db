"""Write and read one checkpoint file: torch.save format, streamed, checksummed, fsynced.

`save_file` writes torch.save's zip format (so torch.load and DeepSpeed's tools read it)
through TorchZipWriter.write_object: each tensor's bytes go straight from the tensor's memory
to the file, in chunks, with no second copy of the state in host RAM, and a view of a big flat
buffer writes only its own bytes (torch.save would write the whole buffer). Tensors on a GPU
pass through the bounded host staging buffer (staging.py, 256 MiB by default, pinned), chunk
by chunk, so the host memory a save needs is that buffer whatever the model's size (plus the
pickled structure, a few KiB, and for a non-contiguous tensor a contiguous copy on its device).
The file object here checksums (checksum.py: hardware CRC-32C) each chunk on a helper thread
(the GIL is released) while this thread writes it, and starts the chunk's write-back to disk
at once (sync_file_range), so the disk works while the next chunk is prepared and the final
fsync has little left to wait for.

`clone_tensors_for_torch_save` is DeepSpeed's copying helper, for users' own torch.save calls.
"""
from __future__ import annotations

import collections
import io
import os
import pickle
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Optional, Tuple, Union

import torch

from .checksum import Checksum, algorithm_of
from ..errors import CheckpointError, crash_point
from .safe_pickle import RefusedGlobal, safe_load
from .staging import CHUNK_BYTES, HostStaging
from .torch_zip_writer import TensorBytesWriter, TorchZipWriter


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


class DeferredFsync:
    """fsync files on a helper thread while the caller writes the next one (the kernel flushes one file
    while the next is written); `wait()` returns when every file is on disk and raises the first error.
    Each file is fsynced through a dup of the descriptor it was written with, so a write-back error
    is reported to us whenever it happened."""

    def __init__(self):
        self.pool = ThreadPoolExecutor(max_workers=1)
        self.pending = []

    @staticmethod
    def _sync(fd: int) -> None:
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def add(self, fd: int, path: str) -> None:
        self.pending.append((path, self.pool.submit(self._sync, os.dup(fd))))

    def wait(self) -> None:
        try:
            for path, done in self.pending:
                try:
                    done.result()
                except OSError as e:
                    raise OSError(e.errno, e.strerror, path) from e
        finally:
            self.pending = []
            self.pool.shutdown(wait=True)


class _ChecksumWriter(TensorBytesWriter):
    """The byte sink of a checkpoint file: os.write in bounded chunks, the checksum alongside.

    A chunk is checksummed on a helper thread while this thread writes it; write() returns
    only when both are done, so no buffer handed to it (a staging slot) is used after the call."""

    def __init__(self, fd: int, path: str, rank: int, fsync: Union[bool, DeferredFsync],
                 staging: Optional[HostStaging] = None):
        super().__init__(fd, staging=staging)
        self.checksum, self.path, self.rank, self.fsync = Checksum(), path, rank, fsync
        self.pool = ThreadPoolExecutor(max_workers=1)

    @property
    def size(self) -> int:
        return self.pos

    def write(self, data) -> None:
        self._write(data)

    def _write(self, data) -> int:
        mv = memoryview(data).cast("B")
        for off in range(0, len(mv), CHUNK_BYTES):
            chunk = mv[off:off + CHUNK_BYTES]
            pending = self.pool.submit(self.checksum.update, chunk) if len(chunk) > (1 << 16) else None
            if pending is None:
                self.checksum.update(chunk)
            done = 0
            while done < len(chunk):
                done += os.write(self.fd, chunk[done:])
            if _START_WRITEBACK is not None and len(chunk) > (1 << 16):  # the disk starts on this chunk at once
                _START_WRITEBACK(self.fd, self.pos, len(chunk))
            self.pos += len(chunk)
            if self.pos > (1 << 16):
                crash_point("mid_file", self.rank)
            if pending is not None:
                pending.result()
        return len(mv)

    def finish(self) -> None:
        self.pool.shutdown(wait=True)
        if isinstance(self.fsync, DeferredFsync):
            self.fsync.add(self.fd, self.path)
        elif self.fsync:
            os.fsync(self.fd)


def save_file(obj: Any, path: str, fsync: Union[bool, DeferredFsync] = True, rank: int = 0,
              staging: Optional[HostStaging] = None) -> Tuple[int, str]:
    """Write `obj` to `path` in torch.save's format (tensors streamed, see above); return (size, checksum
    string). fsync: True fsyncs before returning; a DeferredFsync fsyncs on its thread (its wait())."""
    sink = None

    def make_sink(fd: int) -> _ChecksumWriter:
        nonlocal sink
        sink = _ChecksumWriter(fd, path, rank, fsync, staging)
        return sink

    try:
        zw = TorchZipWriter(path, out=make_sink)
    except OSError as e:
        raise OSError(e.errno, e.strerror, path) from e
    try:
        zw.write_object(obj)
        size = zw.close()
    except OSError as e:
        sink.pool.shutdown(wait=True)
        zw.abort()
        raise OSError(e.errno, e.strerror, path) from e
    return size, str(sink.checksum)


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


def load_file(path: str, mmap: bool = True, checksum: Optional[str] = None,
              device: Optional[torch.device] = None) -> Any:
    """Safely load a checkpoint file (weights only + safe_pickle's allow-list), its tensors onto `device`
    (default the CPU).

    With mmap=True each storage is mapped from the file and, for another device, copied there one
    storage at a time, so the host holds no copy of the file's tensors (only the page cache's pages).

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
                             where=f"the checkpoint file {path}", map_location=device)
        except RuntimeError as e:
            if mmap and data is None and "mmap" in str(e):
                return safe_load(path, mmap=False, where=f"the checkpoint file {path}", map_location=device)
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
