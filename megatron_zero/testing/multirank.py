"""Run a function on N gloo ranks on the CPU and collect what each returns.

    results = run_ranks(fn, 4, arg1, arg2, timeout=120)   # results[rank] = fn(arg1, arg2)

`fn` must be importable (defined at module level). Each rank starts with
torch.distributed initialised (gloo, a free port) and RANK/WORLD_SIZE/LOCAL_RANK/
MASTER_ADDR/MASTER_PORT set, so code under test sees what torchrun would give it.
Ranks are forked from a server process that has already imported torch, so a
rank costs milliseconds to start, not seconds.

Any rank's exception is raised in the caller as RankFailure carrying that rank's
traceback; the other ranks are killed. A rank whose exception only says that it lost contact with
another (a broken connection: a consequence) gives way for a moment to the cause: another rank's
exception, or a rank that died. A rank that dies without a word (signal,
os._exit) is reported with its exit code. Nothing hangs: after `timeout`
seconds the ranks that have not finished are named, their Python stacks are
dumped into the message, and every rank is killed.
"""
from __future__ import annotations

import io
import multiprocessing as mp
import os
import queue
import signal
import socket
import tempfile
import time
import traceback
from typing import Any, Callable, List, Optional

_CTX = None


class RankFailure(AssertionError):
    """A rank raised, died, or did not finish in time."""


def _context():
    global _CTX
    if _CTX is None:
        _CTX = mp.get_context("forkserver")
        _CTX.set_forkserver_preload(["torch", "torch.distributed", "numpy"])
    return _CTX


_HELD_PORTS: List[socket.socket] = []


def free_port() -> int:
    """A port that stays this caller's until the process exits: bound (not listening) with SO_REUSEADDR and held,
    so no other bind and no outgoing connection can take it, while the TCPStore of torchrun or gloo, which binds
    with SO_REUSEADDR too, can listen on it. A port found free and released races everything else on the host."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("127.0.0.1", 0))
    _HELD_PORTS.append(s)
    return s.getsockname()[1]


def _worker(rank, world_size, port, fn, args, kwargs, results, threads, env, stack_dir):
    import faulthandler

    import torch
    import torch.distributed as dist

    stack_file = open(os.path.join(stack_dir, f"rank{rank}.txt"), "w")
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank)})
    os.environ.update(env or {})
    torch.set_num_threads(threads)
    try:
        import datetime
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world_size, timeout=datetime.timedelta(minutes=30))
        value = fn(*args, **kwargs)
        buf = io.BytesIO()
        torch.save(value, buf)
        results.put((rank, "ok", buf.getvalue()))
    except BaseException as err:  # report everything, including SystemExit and KeyboardInterrupt
        from ..distributed.initialize import is_peer_failure
        results.put((rank, "peer" if is_peer_failure(err) else "error", traceback.format_exc()))
    finally:
        from ..distributed.initialize import shutdown_distributed
        shutdown_distributed()


def _kill(procs):
    for p in procs:
        if p.is_alive():
            p.kill()
    for p in procs:
        p.join(5)


def run_ranks(fn: Callable, world_size: int, *args, timeout: float = 300.0, threads: int = 1,
              env: Optional[dict] = None, **kwargs) -> List[Any]:
    """Run fn(*args, **kwargs) on `world_size` gloo ranks; return the per-rank results."""
    import torch

    ctx = _context()
    port = free_port()
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="multirank-") as stack_dir:
        procs = [ctx.Process(target=_worker, daemon=True, name=f"rank{r}",
                             args=(r, world_size, port, fn, args, kwargs, results, threads, env, stack_dir))
                 for r in range(world_size)]
        for p in procs:
            p.start()
        done: dict = {}
        deadline = time.monotonic() + timeout
        try:
            while len(done) < world_size:
                try:
                    rank, status, payload = results.get(timeout=0.2)
                except queue.Empty:
                    _check_silent_deaths(procs, done, results)
                    if time.monotonic() > deadline:
                        stuck = [r for r in range(world_size) if r not in done]
                        raise RankFailure(_stuck_message(fn, stuck, timeout, procs, stack_dir))
                    continue
                if status == "peer":  # the ranks that reported count as done while the cause is looked for
                    _raise_cause(fn, procs, {**done, rank: None}, results, _PEER_GRACE_S)
                if status in ("error", "peer"):
                    raise RankFailure(f"rank {rank} of {world_size} raised in {fn.__name__}:\n{payload}")
                done[rank] = torch.load(io.BytesIO(payload), weights_only=False)
        finally:
            _kill(procs)
    return [done[r] for r in range(world_size)]


_PEER_GRACE_S = 3.0  # how long a rank that lost contact waits for the rank it lost to be found


def _raise_cause(fn, procs, reported, results, grace):
    """Raise the failure that a lost connection was a consequence of, if it shows within `grace` s. `reported`:
    the ranks that have sent their result or error (their exit is no silent death)."""
    world_size = len(procs)
    end = time.monotonic() + grace
    while time.monotonic() < end:
        try:
            rank, status, payload = results.get(timeout=0.1)
        except queue.Empty:
            _check_silent_deaths(procs, reported, results)
            continue
        if status == "error":
            raise RankFailure(f"rank {rank} of {world_size} raised in {fn.__name__}:\n{payload}")
        reported[rank] = None


def _check_silent_deaths(procs, done, results):
    time.sleep(0)  # let a final message arrive before judging a dead process
    for rank, p in enumerate(procs):
        if rank not in done and p.exitcode is not None:
            try:  # it may have reported just before exiting
                r, status, payload = results.get(timeout=1.0)
                results.put((r, status, payload))
                return
            except queue.Empty:
                pass
            code = p.exitcode
            how = f"signal {-code} ({signal.Signals(-code).name})" if code < 0 else f"exit code {code}"
            raise RankFailure(f"rank {rank} died with {how} without reporting a result or an error")


def _stuck_message(fn, stuck, timeout, procs, stack_dir):
    for r in stuck:
        if procs[r].is_alive():
            os.kill(procs[r].pid, signal.SIGUSR1)
    time.sleep(1.0)
    parts = [f"rank(s) {stuck} did not finish {fn.__name__} within {timeout:.0f} s (stuck); killed all ranks."]
    for r in stuck:
        path = os.path.join(stack_dir, f"rank{r}.txt")
        stack = open(path).read().strip() if os.path.exists(path) else ""
        parts.append(f"--- rank {r} stack ---\n{stack or '(no stack captured)'}")
    return "\n".join(parts)
