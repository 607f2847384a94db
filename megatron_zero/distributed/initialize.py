"""torch.distributed initialisation from torchrun's or SLURM's environment.

torchrun sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT.
SLURM (srun, one task per GPU) sets SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID and
SLURM_NODELIST/SLURM_JOB_NODELIST; the master address is the first host of the
node list. The backend is nccl where CUDA is present, else gloo.

Each launch attempt forms its process group from its own store (`attempt_store`): torchrun's agent hosts
one TCPStore at MASTER_ADDR:MASTER_PORT for all the attempts of a run (its --max-restarts restarts and an
elastic job's re-rendezvous), so the process groups' keys go under the attempt's
TORCHELASTIC_RESTART_COUNT; otherwise a restarted attempt reads the addresses its killed predecessor left
there and gloo/NCCL connect to processes that are gone. Where rank 0 hosts the store (SLURM) it dies with
the attempt; a run of one process without a launcher keeps its store in memory (no port: two such runs on one
host, or one beside a torchrun job on the default port, never collide). On NCCL the rank's GPU is bound and named to the process group (device_id).

On NCCL a dead peer raises nothing: the others wait in their collective. Before the process group is
made, `nccl_environment` turns on PyTorch's NCCL watchdog teardown (TORCH_NCCL_ASYNC_ERROR_HANDLING=1:
a collective that fails or outlives --distributed-timeout-minutes aborts the communicators and ends
the process, so the launcher sees it) with the watchdog's heartbeat monitor given the same time
(TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC); values the user exported are kept.

Two guards for a job of many processes:
- `stop_with_launcher`: a worker gets SIGTERM when its launcher (torchrun's agent, the
  SLURM step) dies, through Linux's parent-death signal (prctl PR_SET_PDEATHSIG);
  torchrun puts each worker in a session of its own, so nothing else would reach it.
  With --exit-signal-handler it stops after the iteration and saves, else it dies.
- One failure, one sentence: a rank that fails says its sentence and records it in the
  job's TCPStore (`report_failure`) before it exits; a rank with the same sentence after
  it stays quiet. A rank that then loses contact with the failed one (`is_peer_failure`)
  finds the report (`another_rank_failed`) and exits quietly instead of printing the
  backend's connection traceback.
- Which rank died first: a rank that only lost contact says so in torchrun's error file for it
  (`record_peer_loss`), so the launch script (scripts/pretrain_torchrun.sh) can name, with
  `first_failure`, the rank whose failure was a cause (killed by a signal, or failed on its own)
  rather than the first one torchrun happened to observe.
"""
from __future__ import annotations

import ctypes
import datetime
import os
import re
import signal
import socket
import sys
from dataclasses import dataclass
from typing import Dict, Optional

DEFAULT_PORT = 29500


class LaunchError(RuntimeError):
    """The launch environment is incomplete or inconsistent (one sentence)."""


@dataclass(frozen=True)
class LaunchEnv:
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    source: str  # "torchrun", "slurm" or "single"


def first_host(nodelist: str) -> str:
    """First hostname of a SLURM node list: 'node[03-05,7],gpu1' -> 'node03'.

    This handles the compressed forms SLURM prints; `scontrol show hostnames`
    is the authority when it is available.
    """
    nodelist = nodelist.strip()
    match = re.match(r"([^,\[]+)(\[([^\]]+)\])?", nodelist)
    if not match:
        raise LaunchError(f"cannot read a host from SLURM node list {nodelist!r}")
    prefix, _, ranges = match.groups()
    if not ranges:
        return prefix
    first = ranges.split(",")[0].split("-")[0]
    return prefix + first


def read_launch_env(environ: Optional[dict] = None) -> LaunchEnv:
    env = os.environ if environ is None else environ

    def as_int(name):
        try:
            return int(env[name])
        except ValueError:
            raise LaunchError(f"environment variable {name}={env[name]!r} is not an integer") from None

    port = int(env.get("MASTER_PORT", DEFAULT_PORT))
    if "RANK" in env and "WORLD_SIZE" in env:
        return LaunchEnv(as_int("RANK"), as_int("WORLD_SIZE"), int(env.get("LOCAL_RANK", 0)),
                         env.get("MASTER_ADDR", "127.0.0.1"), port, "torchrun")
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        addr = env.get("MASTER_ADDR")
        if not addr:
            nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
            if not nodelist:
                raise LaunchError("SLURM_PROCID is set but neither MASTER_ADDR nor SLURM_JOB_NODELIST is; "
                                  "cannot tell where rank 0 runs")
            addr = first_host(nodelist)
        return LaunchEnv(as_int("SLURM_PROCID"), as_int("SLURM_NTASKS"), int(env.get("SLURM_LOCALID", 0)),
                         addr, port, "slurm")
    return LaunchEnv(0, 1, 0, env.get("MASTER_ADDR", "127.0.0.1"), port, "single")


def default_backend() -> str:
    import torch
    return "nccl" if torch.cuda.is_available() else "gloo"


def nccl_environment(timeout_minutes: float) -> Dict[str, str]:
    """PyTorch's NCCL settings for a job whose collectives may wait `timeout_minutes` (module docstring)."""
    return {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
            "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": str(max(60, int(timeout_minutes * 60)))}


def attempt_prefix(environ: Optional[dict] = None) -> str:
    """The key prefix of this launch attempt in the launcher's store: torchrun's agent keeps one store for
    every attempt of a run (its restarts and re-rendezvous), so keys left by an earlier attempt (gloo's
    addresses, a subgroup's, a failure report) would be read by the next one; TORCHELASTIC_RESTART_COUNT
    tells the attempts apart. Empty where the store dies with the attempt (rank 0 hosts it: SLURM, one
    process, torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1)."""
    env = os.environ if environ is None else environ
    if env.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() != "true":
        return ""
    return f"megatron_zero/attempt_{env.get('TORCHELASTIC_RESTART_COUNT', '0')}/"


def attempt_store(launch: LaunchEnv, timeout: datetime.timedelta, environ: Optional[dict] = None,
                  host: bool = True):
    """A client of this attempt's key-value store (attempt_prefix); rank 0 hosts it where the launcher does
    not (`host`: when forming the process group, not when looking up a report afterwards)."""
    import torch.distributed as dist

    if launch.source == "single":  # no other process to reach it: no port, so no run on this host to collide with
        return dist.HashStore()
    prefix = attempt_prefix(environ)
    store = dist.TCPStore(launch.master_addr, launch.master_port, launch.world_size,
                          is_master=host and not prefix and launch.rank == 0, timeout=timeout,
                          wait_for_workers=False)
    return dist.PrefixStore(prefix, store) if prefix else store


def init_distributed(backend: Optional[str] = None, timeout_minutes: float = 10.0,
                     environ: Optional[dict] = None, device=None) -> LaunchEnv:
    """Initialise the default process group from the launch environment of this attempt (attempt_store;
    idempotent); on NCCL with nccl_environment's settings in os.environ first (ProcessGroupNCCL reads them when
    it is made) and the rank's GPU (`device`, else cuda:<LOCAL_RANK>) bound before any collective and named to
    the process group, so no collective guesses the device from the rank."""
    import torch
    import torch.distributed as dist

    from .shm_comm import set_timeout

    launch = read_launch_env(environ)
    set_timeout(timeout_minutes * 60)  # the shared-memory collectives wait as long as gloo's
    if dist.is_initialized():
        return launch
    backend = backend or default_backend()
    timeout = datetime.timedelta(minutes=timeout_minutes)
    bound = {}
    if backend == "nccl":
        for name, value in nccl_environment(timeout_minutes).items():
            os.environ.setdefault(name, value)
        if device is None or device.type != "cuda" or device.index is None:
            device = torch.device("cuda", launch.local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        bound = {"device_id": device}
    store = attempt_store(launch, timeout, environ)
    dist.init_process_group(backend=backend, store=store, rank=launch.rank, world_size=launch.world_size,
                            timeout=timeout, **bound)
    if launch.world_size > 1:  # where each rank runs, for the sentence of a rank that loses contact with it
        store.set(f"{WHERE}{launch.rank}", f"{socket.gethostname()} {os.getpid()}")
    return launch


PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
FAILURE_COUNT, FAILURE_MESSAGE, WHERE = "megatron_zero/failures", "megatron_zero/failure", "megatron_zero/where/"
STORE_TIMEOUT = datetime.timedelta(seconds=5)


def stop_with_launcher(sig: int = signal.SIGTERM) -> bool:
    """Have the kernel send `sig` to this process when its parent dies (Linux); False where unsupported."""
    if not sys.platform.startswith("linux"):
        return False
    parent = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        return False
    if os.getppid() != parent:  # the launcher died before the request was in place
        os.kill(os.getpid(), sig)
    return True


def _job_store(environ: Optional[dict] = None):
    """A client of this attempt's store (attempt_store; torchrun's agent or rank 0 hosts it), or None."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    try:
        return attempt_store(read_launch_env(environ), STORE_TIMEOUT, environ, host=False)
    except (RuntimeError, ValueError):  # the host of the store is gone
        return None


def report_failure(message: str, say) -> None:
    """say(message) unless another rank has already said the same; then record it for the other ranks."""
    store = _job_store()
    if store is None:
        say(message)
        return
    try:
        first = store.add(FAILURE_COUNT, 1) == 1
        if not first and store.get(FAILURE_MESSAGE).decode() == message:  # get waits for the first to say it
            return
    except RuntimeError:
        first = False
    say(message)
    if first:
        store.set(FAILURE_MESSAGE, message)


def another_rank_failed() -> bool:
    """Whether some rank has reported a failure of its own (and said it)."""
    store = _job_store()
    try:
        if store is None or not store.check([FAILURE_COUNT]):
            return False
        store.wait([FAILURE_MESSAGE], STORE_TIMEOUT)
        return True
    except RuntimeError:
        return False


def shutdown_distributed() -> None:
    """Destroy every process group while the interpreter is whole, after the caller dropped its references.

    A gloo worker thread releases each finished collective's tensors after the caller's wait returned;
    releasing a tensor that Python once held takes the GIL. If that happens while the interpreter is
    finalizing, the thread is unwound through C++ and the process aborts ("terminate called without an
    active exception"), a race seen on about one exit in ten. Freeing the groups here (the garbage
    collector finds the subgroup handles that reference cycles in the model keep alive) joins those
    threads first; the C++ destructor waits for their queues with the GIL released.
    """
    import gc

    import torch.distributed as dist

    from .shm_comm import release_groups

    release_groups()  # its table of groups would keep them alive
    if not dist.is_initialized():
        return
    gc.collect()
    dist.destroy_process_group()
    gc.collect()


def is_peer_failure(err: BaseException) -> bool:
    """A collective broken because another rank went away (gloo/NCCL connection errors, a timeout)."""
    import torch.distributed as dist

    text = str(err)
    return isinstance(err, dist.DistError) or (isinstance(err, RuntimeError) and any(
        s in text for s in ("Connection closed by peer", "Connection reset by peer", "gloo/transport", "NCCL")))


def _state(pid: int) -> str:
    """The process state letter of /proc/<pid>/stat ("Z" zombie, "T" stopped, ...); "X" where it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "X"


def ranks_gone(environ: Optional[dict] = None) -> Dict[int, str]:
    """{rank: where} of the ranks of this attempt that are gone or stopped, as far as this rank can tell: those
    on its own host whose process has exited ("host") or is stopped ("host (stopped)": SIGSTOP, a debugger);
    a rank elsewhere cannot be checked from here. {} where the store is gone too."""
    launch = read_launch_env(environ)
    store, here, found = _job_store(environ), socket.gethostname(), {}
    if store is None:
        return found
    for rank in range(launch.world_size):
        try:
            host, pid = store.get(f"{WHERE}{rank}").decode().rsplit(" ", 1)
        except (RuntimeError, ValueError):  # never registered (it died in start-up), or the store is gone
            continue
        state = _state(int(pid)) if rank != launch.rank and host == here else "R"
        if state in ("Z", "X"):
            found[rank] = host
        elif state in ("T", "t"):
            found[rank] = f"{host} (stopped)"
    return found


def lost_contact_line(err: BaseException, environ: Optional[dict] = None) -> str:
    """The sentence of a rank whose collective broke because another went away: this rank by its launch
    environment (there may be no process group, when it broke while being made), the ranks gone by name and
    host where ranks_gone finds them."""
    try:
        launch = read_launch_env(environ)
        me, gone = f"rank {launch.rank}", ranks_gone(environ)
    except (LaunchError, RuntimeError, ValueError):
        me, gone = "this rank", {}
    other = ("another rank" if not gone else ", ".join(f"rank {r} on {h}" for r, h in sorted(gone.items())))
    return (f"{me} on {socket.gethostname()} lost contact with {other} ({str(err).splitlines()[0][:200]}); "
            + ("that rank's log says why" if len(gone) < 2 else "their logs say why"))


class PeerLostError(RuntimeError):
    """This rank's collective broke because another rank went away: a consequence, not a cause."""


def record_peer_loss(message: str) -> None:
    """Write `message` as a PeerLostError into torchrun's error file for this worker (when there is one)."""
    if not os.environ.get("TORCHELASTIC_ERROR_FILE"):
        return
    from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

    ErrorHandler().record_exception(PeerLostError(message))


def _lost_contact(failure) -> bool:
    message = failure.message.get("message", "") if isinstance(failure.message, dict) else str(failure.message)
    return message.startswith(PeerLostError.__name__)


def first_failure(failures: Dict[int, object]) -> str:
    """One line naming the rank that failed first, from torchrun's {global rank: ProcessFailure}: the earliest
    failure that is not a lost contact (record_peer_loss), else the earliest; among failures of the same
    second, the one torchrun lists first (observed first: the others are ranks it stopped after it)."""
    causes = {rank: f for rank, f in failures.items() if not _lost_contact(f)} or failures
    rank, failure = min(causes.items(), key=lambda item: item[1].timestamp)
    how = f"killed by signal {failure.signal_name()}" if failure.exitcode < 0 else f"exit code {failure.exitcode}"
    after = len(failures) - 1
    return (f"rank {rank} (local rank {failure.local_rank}, pid {failure.pid}) failed first: {how}"
            + (f"; {after} other rank{'s' if after > 1 else ''} failed after it" if after else ""))
