"""Every rank writes its own files, in parallel; rank 0 commits when all are done. Sync or async.

    writer = get_writer()
    writer.save(save_dir, tag, [(file_name, obj), ...], iteration=k, meta={...},
                async_save=False, keep_last_k=None)
    writer.wait()      # async: block until this rank's files are written (rank 0: and committed)

Synchronous: write (each file fsynced on a helper thread while the next is written; all on
disk before the part), record a manifest part, exchange outcomes, rank 0 commits, exchange
outcomes (the two collectives of a save that succeeds, besides the id's broadcast). A failed
write or commit on any rank (a full disk, any I/O error) stops the save on every rank with one
sentence (the file, the bytes the checkpoint needs, the bytes free); rank 0
removes the partial temporary directory; earlier checkpoints and `latest` are never touched.
Asynchronous: the call returns at once, copying nothing: a background thread writes the
files straight from the live tensors (as a synchronous save does), then the
part; rank 0's thread waits for every rank's part to appear in the shared directory, then
commits. A rank whose write fails leaves a failure marker there instead (manifest.write_failure),
so rank 0 stops at once with that rank's sentence (its file, rank and reason), removes the partial
directory and commits nothing, rather than waiting for the commit timeout. The state must not change while it is being read, so its owner waits on
`wait_until_state_read()` before mutating it (save_checkpoint registers that with the
optimizer, whose next step() calls it first): the save overlaps the next forward and backward,
and the step waits only for what is left. Extra host memory, sync or async: host tensors are
written from their own memory; device tensors pass through the bounded staging buffer
(staging.py, 256 MiB by default), so a save needs at most that buffer whatever the state's size.
No collective runs in the background thread, so it never races the training loop's
collectives. The next save, and `wait()`, block until the previous one is done; errors surface
there (a failed background write removes the partial directory the same way).
"""
from __future__ import annotations

import atexit
import os
import shutil
import threading
import time
from typing import Any, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from .commit import commit, new_save_id, tmp_dir
from ..errors import CheckpointError
from .manifest import failed_ranks, parts_present, write_failure, write_part
from .checksum import file_checksum
from .tensor_io import DeferredFsync, map_tensors, save_file


class CopyFile:
    """A plan entry that copies an existing file (e.g. zero_to_fp32.py) into the checkpoint."""

    def __init__(self, src: str, executable: bool = False):
        self.src, self.executable = src, executable


def _rank_world():
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def plan_bytes(plan: Sequence[Tuple[str, Any]]) -> int:
    """About how many bytes this rank's files take (tensor bytes and copied files; pickles add little)."""
    total = 0

    def count(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    for _, obj in plan:
        if isinstance(obj, CopyFile):
            total += os.path.getsize(obj.src)
        else:
            map_tensors(obj, count)
    return total


def _what_failed(err: BaseException, save_dir: str) -> Tuple[str, str]:
    """(the file, what went wrong) of a failed write (an OSError names its file; other errors: the save
    directory)."""
    what = getattr(err, "strerror", None) or (str(err).splitlines() or [type(err).__name__])[0]
    return getattr(err, "filename", None) or save_dir, what


def _failure(save_dir: str, tag: str, failed: Tuple[str, str], needed: int, rank: Optional[int] = None) -> str:
    """One sentence for a save that failed writing `failed` = (file, what); `needed`: the bytes of the
    whole checkpoint, or, with `rank` named (an async save, no collective), of that rank's files."""
    where, what = failed
    whose, on = ("the checkpoint needs", "") if rank is None else (f"rank {rank}'s files need", f" on rank {rank}")
    try:
        free = shutil.disk_usage(save_dir).free
        room = f"; {whose} about {needed} bytes and {free} bytes are free"
    except OSError:
        room = ""
    return (f"saving checkpoint {tag} into {save_dir} failed{on} writing {where}: {what}{room}; the partial "
            "checkpoint was removed, earlier checkpoints and `latest` are intact")


def _all_outcomes(outcome: Any, world: int) -> List[Any]:
    """Every rank's outcome (None: fine, else (file, what failed)); a collective that replaces a barrier."""
    if world == 1:
        return [outcome]
    out = [None] * world
    dist.all_gather_object(out, outcome)
    return out


def _write_files(directory: str, plan: Sequence[Tuple[str, Any]], rank: int) -> dict:
    """Write this rank's files; each is fsynced on a helper thread while the next is written, and all
    are on disk when this returns."""
    files, synced = {}, DeferredFsync()
    try:
        for name, obj in plan:
            path = os.path.join(directory, name)
            if isinstance(obj, CopyFile):
                shutil.copyfile(obj.src, path)
                if obj.executable:
                    os.chmod(path, 0o755)
                with open(path, "rb") as f:
                    synced.add(f.fileno(), path)
                files[name] = {"size": os.path.getsize(path), "checksum": file_checksum(path)}
            else:
                size, checksum = save_file(obj, path, fsync=synced, rank=rank)
                files[name] = {"size": size, "checksum": checksum}
    finally:
        synced.wait()
    return files


class CheckpointWriter:
    def __init__(self):
        self._thread: Optional[threading.Thread] = None
        self._state_read = threading.Event()
        self._state_read.set()
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
        meta = dict(meta or {}, iteration=iteration, world_size=world)
        args = (save_dir, tag, tmp, rank, world, meta, iteration, save_latest, keep_last_k)
        if not async_save:
            self._save_sync(save_dir, tag, tmp, plan, rank, world, meta, iteration, save_latest, keep_last_k)
            return
        # the containers are copied now (the caller may change them); the tensors stay the live ones
        plan = [(n, o if isinstance(o, CopyFile) else map_tensors(o, lambda t: t)) for n, o in plan]
        self._error = None
        self._state_read.clear()
        self._thread = threading.Thread(target=self._background, args=(plan,) + args,
                                        name="megatron_zero-async-save", daemon=True)
        self._thread.start()

    def _save_sync(self, save_dir, tag, tmp, plan, rank, world, meta, iteration, save_latest, keep_last_k):
        for step in ("write", "commit"):
            outcome = None
            try:
                if step == "write":
                    os.makedirs(tmp, exist_ok=True)
                    write_part(tmp, rank, _write_files(tmp, plan, rank))
                elif rank == 0:
                    commit(save_dir, tag, tmp, world, meta, iteration, save_latest, keep_last_k)
            except OSError as e:
                outcome = _what_failed(e, save_dir)
            failed = [o for o in _all_outcomes(outcome, world) if o is not None]
            if failed:  # the bytes every rank needed, for the sentence (only on failure: no collective otherwise)
                sentence = _failure(save_dir, tag, failed[0], sum(_all_outcomes(plan_bytes(plan), world)))
                if rank == 0:
                    shutil.rmtree(tmp, ignore_errors=True)
                if world > 1:
                    dist.barrier()  # the partial directory is gone on return, on every rank
                raise CheckpointError(sentence)

    def _background(self, plan, save_dir, tag, tmp, rank, world, meta, iteration, save_latest, keep_last_k):
        try:
            try:
                os.makedirs(tmp, exist_ok=True)
                files = _write_files(tmp, plan, rank)
                write_part(tmp, rank, files)
            except Exception as e:  # a full disk, any I/O error, a tensor that cannot be read
                failed = _what_failed(e, save_dir)
                if rank == 0:
                    shutil.rmtree(tmp, ignore_errors=True)
                else:  # rank 0 is polling for the parts: tell it now, not at its commit timeout
                    write_failure(tmp, rank, {"file": failed[0], "what": failed[1], "needed": plan_bytes(plan)})
                raise CheckpointError(_failure(save_dir, tag, failed, plan_bytes(plan), rank)) from e
            finally:
                self._state_read.set()
            if rank != 0:
                return
            self._wait_for_parts(save_dir, tag, tmp, world)
            try:
                commit(save_dir, tag, tmp, world, meta, iteration, save_latest, keep_last_k)
            except OSError as e:
                shutil.rmtree(tmp, ignore_errors=True)
                raise CheckpointError(_failure(save_dir, tag, _what_failed(e, save_dir), plan_bytes(plan), rank)) from e
        except BaseException as e:  # surfaced by wait()
            self._error = e

    def _wait_for_parts(self, save_dir, tag, tmp, world):
        """Rank 0 of an async save: wait until every rank's part is there; a rank's failure marker (or
        the commit timeout) ends the save uncommitted, the partial directory removed."""
        deadline = time.monotonic() + self.commit_timeout
        while not parts_present(tmp, world):
            failed = failed_ranks(tmp, world)
            if failed:
                r, info = min(failed.items())
                info = info or {"file": f"its files in {tmp}", "what": "it could not record why", "needed": 0}
                shutil.rmtree(tmp, ignore_errors=True)
                raise CheckpointError(_failure(save_dir, tag, (info["file"], info["what"]), int(info["needed"]), r))
            if time.monotonic() > deadline:
                raise CheckpointError(f"not every rank finished writing {tmp} within {self.commit_timeout:.0f} s; "
                                      "the checkpoint was not committed")
            time.sleep(0.02)

    @property
    def pending(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def wait_until_state_read(self) -> None:
        """Block until the pending async save has read every tensor of the state (errors surface in wait())."""
        self._state_read.wait()

    def wait(self) -> None:
        """Block until the previous async save of this rank is written (and, on rank 0, committed)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            err, self._error = self._error, None
            raise CheckpointError(str(err) if isinstance(err, CheckpointError) else
                                  f"the asynchronous checkpoint save failed: {err}") from err


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
