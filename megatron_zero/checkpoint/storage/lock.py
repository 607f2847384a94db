"""One writer per checkpoint directory: a lock file naming the job that saves there.

    lock = hold_save_lock(save_dir)   # every rank, at start-up; global rank 0 takes the lock
    ...
    lock.release()                    # at the end (a no-op on other ranks)

`<save>/.megatron_zero.lock` holds JSON naming the holder: host, pid, the kernel's start
time of that process (/proc/<pid>/stat, so a reused pid is told apart) and when it took
the lock. It is created with O_EXCL under an flock on `<lock>.guard`, so two jobs never
both take it. An existing lock is

    stale    on this host, when its pid is gone or is another process now: taken over,
             with one line saying whose it was
    live     otherwise: the job is refused with one sentence naming the holder and the
             file to remove if that job is gone (a holder on another host cannot be
             checked from here)
"""
from __future__ import annotations

import contextlib
import datetime
import fcntl
import json
import os
import socket
from typing import Optional

from ..errors import CheckpointError

LOCK_NAME = ".megatron_zero.lock"


def _stat_fields(pid: int) -> Optional[list]:
    """The fields of /proc/<pid>/stat after the command name (field 3, the state, first); None without one."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def process_start(pid: int) -> Optional[str]:
    """Field 22 of /proc/<pid>/stat (start time in clock ticks since boot); None without such a process."""
    fields = _stat_fields(pid)
    return fields[19] if fields is not None and len(fields) > 19 else None


def _running(holder: dict) -> bool:
    """Whether the holder (on this host) is still the process that took the lock. A zombie (it has exited
    and waits for its parent to reap it, as orphaned workers may for a while) is not running."""
    try:
        os.kill(int(holder["pid"]), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    fields = _stat_fields(int(holder["pid"]))
    if fields is not None and fields[0] in ("Z", "X"):
        return False
    recorded, now = holder.get("process_start"), process_start(int(holder["pid"]))
    return recorded is None or now is None or recorded == now


@contextlib.contextmanager
def _guard(path: str):
    with open(path + ".guard", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _read(path: str) -> Optional[dict]:
    try:
        with open(path) as f:
            holder = json.load(f)
        return holder if isinstance(holder, dict) and {"host", "pid"} <= holder.keys() else None
    except (OSError, ValueError):
        return None


class SaveLock:
    def __init__(self, path: Optional[str], holder: Optional[dict]):
        self.path, self.holder = path, holder

    def release(self) -> None:
        """Remove the lock if it is still ours."""
        if self.path and _read(self.path) == self.holder:
            with contextlib.suppress(FileNotFoundError):
                os.remove(self.path)
        self.path = None


def acquire(save_dir: str, log=print) -> SaveLock:
    """Take the lock of save_dir for this process, or raise CheckpointError naming the holder."""
    path = os.path.join(save_dir, LOCK_NAME)
    me = {"host": socket.gethostname(), "pid": os.getpid(), "process_start": process_start(os.getpid()),
          "since": datetime.datetime.now().astimezone().isoformat(timespec="seconds")}
    try:
        os.makedirs(save_dir, exist_ok=True)
        with _guard(path):
            if os.path.exists(path):
                holder = _read(path)
                if holder is not None and (holder["host"] != me["host"] or _running(holder)):
                    raise CheckpointError(
                        f"--save {save_dir} is being written by another job: {path} names pid {holder['pid']} on "
                        f"host {holder['host']}, holding it since {holder.get('since', '?')}; stop that job or give "
                        f"another --save (if that job is gone, remove {path})")
                whose = ("an unreadable lock" if holder is None else
                         f"the lock of pid {holder['pid']} (since {holder.get('since', '?')}), which is no longer running")
                log(f"taking over {path}: {whose}")
                os.remove(path)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            with os.fdopen(fd, "w") as f:
                json.dump(me, f)
                f.flush()
                os.fsync(f.fileno())
    except OSError as err:
        raise CheckpointError(f"--save {save_dir} cannot hold its lock file {path}: {err.strerror}") from None
    return SaveLock(path, me)


def hold_save_lock(save_dir: str) -> SaveLock:
    """Collective: global rank 0 takes the lock; every rank raises the same CheckpointError if it cannot."""
    import torch.distributed as dist

    lock, refusal = SaveLock(None, None), [None]
    if not dist.is_initialized() or dist.get_rank() == 0:
        try:
            lock = acquire(save_dir)
        except CheckpointError as err:
            refusal = [str(err)]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(refusal, src=0)
    if refusal[0]:
        raise CheckpointError(refusal[0])
    return lock
