"""Every rank writes its own files, in parallel; rank 0 commits when all are done. Sync or async.

    writer = get_writer()
    writer.save(save_dir, tag, [(file_name, obj), ...], iteration=k, meta={...},
                async_save=False, keep_last_k=None)
    writer.wait()      # async: block until this rank's files are written (rank 0: and committed)

Synchronous: write, fsync, record a manifest part, barrier, rank 0 commits, barrier.
Asynchronous: the call returns once the state is copied into host buffers (reused from
save to save); a background thread writes the files and the part; rank 0's thread waits
for every rank's part to appear in the shared directory, then commits. No collective
runs in the background thread, so it never races the training loop's collectives. The
next save, and `wait()`, block until the previous one is done; errors surface there.
"""
from __future__ import annotations

import atexit
import os
import shutil
import threading
import time
from collections import defaultdict
from typing import Any, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from ..device import host_empty, synchronize
from .commit import commit, new_save_id, tmp_dir
from .errors import CheckpointError
from .manifest import parts_present, write_part
from .tensor_io import file_checksum, map_tensors, save_file


class CopyFile:
    """A plan entry that copies an existing file (e.g. zero_to_fp32.py) into the checkpoint."""

    def __init__(self, src: str, executable: bool = False):
        self.src, self.executable = src, executable


class HostBuffers:
    """Host copies of the state for async saves (pinned for GPU tensors, copied without blocking, one
    wait at the end); buffers are kept and reused by the next save."""

    def __init__(self):
        self.free = defaultdict(list)

    def snapshot(self, obj: Any) -> Tuple[Any, List[torch.Tensor]]:
        used, devices = [], set()

        def copy(t: torch.Tensor) -> torch.Tensor:
            devices.add(t.device)
            key = (t.dtype, t.numel())
            buf = self.free[key].pop() if self.free[key] else host_empty(t.numel(), t.dtype, t.device)
            buf.copy_(t.detach().reshape(-1), non_blocking=True)  # pinned when t is on a GPU
            used.append(buf)
            return buf.view(t.shape)

        snap = map_tensors(obj, copy)
        for device in devices:
            synchronize(device)  # every non-blocking copy has landed before the writer thread reads
        return snap, used

    def release(self, used: List[torch.Tensor]) -> None:
        for buf in used:
            self.free[(buf.dtype, buf.numel())].append(buf)


def _rank_world():
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _write_files(directory: str, plan: Sequence[Tuple[str, Any]], rank: int) -> dict:
    files = {}
    for name, obj in plan:
        path = os.path.join(directory, name)
        if isinstance(obj, CopyFile):
            shutil.copyfile(obj.src, path)
            if obj.executable:
                os.chmod(path, 0o755)
            with open(path, "rb") as f:
                os.fsync(f.fileno())
            files[name] = {"size": os.path.getsize(path), "checksum": file_checksum(path)}
        else:
            size, checksum = save_file(obj, path, rank=rank)
            files[name] = {"size": size, "checksum": checksum}
    return files


class CheckpointWriter:
    def __init__(self):
        self.buffers = HostBuffers()
        self._thread: Optional[threading.Thread] = None
        self._error: Optional[BaseException] = None
        self.commit_timeout = float(os.environ.get("MEGATRON_ZERO_CKPT_COMMIT_TIMEOUT", 3600))

    def save(self, save_dir: str, tag: str, plan: Sequence[Tuple[str, Any]], iteration: Optional[int] = None,
             meta: Optional[dict] = None, async_save: bool = False, keep_last_k: Optional[int] = None,
             save_latest: bool = True) -> None:
        """Collective: every rank calls it with the same save_dir/tag and its own plan."""
        self.wait()
        rank, world = _rank_world()
        ids = [new_save_id() if rank == 0 else None]
        if world > 1:
            dist.broadcast_object_list(ids, src=0)
        tmp = tmp_dir(save_dir, tag, ids[0])
        os.makedirs(tmp, exist_ok=True)
        meta = dict(meta or {}, iteration=iteration, world_size=world)
        args = (save_dir, tag, tmp, rank, world, meta, iteration, save_latest, keep_last_k)
        if not async_save:
            write_part(tmp, rank, _write_files(tmp, plan, rank))
            if world > 1:
                dist.barrier()
            if rank == 0:
                commit(save_dir, tag, tmp, world, meta, iteration, save_latest, keep_last_k)
            if world > 1:
                dist.barrier()
            return
        snap, used = self.buffers.snapshot([(n, o) for n, o in plan if not isinstance(o, CopyFile)])
        snap += [(n, o) for n, o in plan if isinstance(o, CopyFile)]
        self._error = None
        self._thread = threading.Thread(target=self._background, args=(snap, used) + args,
                                        name="megatron_zero-async-save", daemon=True)
        self._thread.start()

    def _background(self, plan, used, save_dir, tag, tmp, rank, world, meta, iteration, save_latest, keep_last_k):
        try:
            write_part(tmp, rank, _write_files(tmp, plan, rank))
            self.buffers.release(used)
            if rank != 0:
                return
            deadline = time.monotonic() + self.commit_timeout
            while not parts_present(tmp, world):
                if time.monotonic() > deadline:
                    raise CheckpointError(f"not every rank finished writing {tmp} within {self.commit_timeout:.0f} s; "
                                          "the checkpoint was not committed")
                time.sleep(0.02)
            commit(save_dir, tag, tmp, world, meta, iteration, save_latest, keep_last_k)
        except BaseException as e:  # surfaced by wait()
            self._error = e

    @property
    def pending(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def wait(self) -> None:
        """Block until the previous async save of this rank is written (and, on rank 0, committed)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            err, self._error = self._error, None
            raise CheckpointError(f"the asynchronous checkpoint save failed: {err}") from err


_WRITER: Optional[CheckpointWriter] = None


def get_writer() -> CheckpointWriter:
    global _WRITER
    if _WRITER is None:
        _WRITER = CheckpointWriter()
        atexit.register(_WRITER.wait)
    return _WRITER


def wait_for_pending_save() -> None:
    """Finish the previous async save of this process (call before exit; the next save calls it too)."""
    if _WRITER is not None:
        _WRITER.wait()
