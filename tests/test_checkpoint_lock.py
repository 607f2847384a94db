"""One writer per --save directory: a lock naming host, pid and start time; stale locks taken over."""
import json
import os
import socket
import subprocess
import sys
import time

import pytest

from megatron_zero.checkpoint.errors import CheckpointError
from megatron_zero.checkpoint.storage.lock import LOCK_NAME, acquire, process_start


def write_lock(save, **holder):
    save.mkdir(exist_ok=True)
    (save / LOCK_NAME).write_text(json.dumps(dict({"host": socket.gethostname(), "since": "earlier"}, **holder)))


def dead_pid():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_take_release_and_a_live_holder_is_refused(tmp_path):
    save = tmp_path / "ckpt"
    lock = acquire(str(save))
    holder = json.loads((save / LOCK_NAME).read_text())
    assert holder["pid"] == os.getpid() and holder["host"] == socket.gethostname()
    assert holder["process_start"] == process_start(os.getpid()) and holder["since"]
    with pytest.raises(CheckpointError) as refused:
        acquire(str(save))  # this process holds it: a second job here is refused
    assert f"names pid {os.getpid()} on host {socket.gethostname()}" in str(refused.value)
    assert f"remove {save / LOCK_NAME}" in str(refused.value)
    lock.release()
    assert not (save / LOCK_NAME).exists()
    acquire(str(save)).release()


def test_stale_locks_are_taken_over_with_a_line(tmp_path):
    save = tmp_path / "ckpt"
    lines = []
    pid = dead_pid()
    write_lock(save, pid=pid, process_start="1")
    acquire(str(save), log=lines.append).release()
    assert len(lines) == 1 and f"pid {pid}" in lines[0] and "no longer running" in lines[0]
    write_lock(save, pid=os.getppid(), process_start="0")  # a live pid, but another process than the holder
    acquire(str(save), log=lines.append).release()
    assert len(lines) == 2 and f"pid {os.getppid()}" in lines[1]
    (save / LOCK_NAME).write_text("")  # a holder that died between creating and writing it
    acquire(str(save), log=lines.append).release()
    assert "an unreadable lock" in lines[2]


def test_a_zombie_holder_is_stale(tmp_path):
    """An orphaned worker that has exited but is not yet reaped still answers kill(pid, 0) with its own
    start time: the lock is still stale."""
    save = tmp_path / "ckpt"
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        deadline = time.monotonic() + 30
        while open(f"/proc/{proc.pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z":
            assert time.monotonic() < deadline
            time.sleep(0.05)
        write_lock(save, pid=proc.pid, process_start=process_start(proc.pid))
        lines = []
        acquire(str(save), log=lines.append).release()
        assert len(lines) == 1 and f"pid {proc.pid}" in lines[0]
    finally:
        proc.wait()


def test_a_holder_on_another_host_is_not_second_guessed(tmp_path):
    save = tmp_path / "ckpt"
    write_lock(save, pid=dead_pid(), host="node-elsewhere")
    with pytest.raises(CheckpointError, match="on host node-elsewhere"):
        acquire(str(save))


def test_an_unusable_save_path_is_one_sentence(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(CheckpointError, match=r"--save .*file/ckpt cannot hold its lock file"):
        acquire(str(tmp_path / "file" / "ckpt"))
