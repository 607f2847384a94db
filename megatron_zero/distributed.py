"""torch.distributed initialisation from torchrun's or SLURM's environment.

torchrun sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT.
SLURM (srun, one task per GPU) sets SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID and
SLURM_NODELIST/SLURM_JOB_NODELIST; the master address is the first host of the
node list. The backend is nccl where CUDA is present, else gloo.
"""
from __future__ import annotations

import datetime
import os
import re
from dataclasses import dataclass
from typing import Optional

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


def init_distributed(backend: Optional[str] = None, timeout_minutes: float = 10.0,
                     environ: Optional[dict] = None) -> LaunchEnv:
    """Initialise the default process group from the launch environment (idempotent)."""
    import torch
    import torch.distributed as dist

    launch = read_launch_env(environ)
    if dist.is_initialized():
        return launch
    backend = backend or default_backend()
    if backend == "nccl":
        torch.cuda.set_device(launch.local_rank % torch.cuda.device_count())
    dist.init_process_group(
        backend=backend,
        init_method=f"tcp://{launch.master_addr}:{launch.master_port}",
        rank=launch.rank,
        world_size=launch.world_size,
        timeout=datetime.timedelta(minutes=timeout_minutes),
    )
    return launch
