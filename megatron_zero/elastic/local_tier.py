"""The node-local checkpoint tier: a checkpoint every --non-persistent-save-interval iterations in
--non-persistent-local-ckpt-dir (fast storage on the ranks' host), the persistent --save less often.

    tier = LocalTier(elastic, async_save, state, world_size)   # collective when on: every rank's host, compared
    where = resume_dir(elastic, load, log)   # the directory a (re)start loads from (`load`: --load)
    tier.after_step(trainer, iteration)      # saves when due (not where --save just saved)

Each local save is an ordinary checkpoint written through the same path as --save's (every rank's files in
a temporary directory, fsynced, rank 0's manifest, the rename, `latest`: storage/commit.py), async with
--async-save, and only the newest is kept. So a local copy is whole or absent, and it loads like any other
(reshaped at another world size).

Restore policy: a start loads the newest complete checkpoint of the two tiers by iteration: the local copy
when it is newer than --load's newest (or there is no --load), else --load. Every rank of the job must reach
the local directory, so the tier needs all ranks on one host (a job over several hosts is refused in one
sentence; each host's local disk would hold only its own ranks' files).
"""
from __future__ import annotations

import os
import re
import socket
import time
from typing import Callable, Optional

import torch.distributed as dist

from .. import checkpoint as ckpt
from ..checkpoint.report import async_started_line, saved_line
from ..checkpoint.storage.commit import committed_tags


def _newest(directory: Optional[str]) -> int:
    """The iteration of the newest complete checkpoint in `directory`; -1 without one."""
    if not directory or not os.path.isdir(directory):
        return -1
    tags = committed_tags(directory)
    found = re.search(r"(\d+)$", tags[-1]) if tags else None
    return int(found.group(1)) if found else -1


def resume_dir(elastic, load: Optional[str], log: Callable[[str], None]) -> Optional[str]:
    """The directory this start loads from: --load, or the local tier's (`elastic`: the run's ElasticConfig) when
    its newest checkpoint is newer."""
    local = elastic.non_persistent_local_ckpt_dir if elastic.non_persistent_save_interval else None
    here, there = _newest(local), _newest(load)
    if here < 0 or here <= there:
        return load
    log(f"resuming from the local checkpoint tier {local} (iteration {here}), newer than "
        + (f"--load {load}'s (iteration {there})" if there >= 0 else "any under --load"))
    return local


class LocalTier:
    def __init__(self, elastic, async_save: bool, state, world_size: int):
        """`elastic`: the run's ElasticConfig (--non-persistent-*); `async_save`: --async-save."""
        self.interval = elastic.non_persistent_save_interval
        self.dir = elastic.non_persistent_local_ckpt_dir
        self.async_save = async_save
        self.state = state
        if not self.interval:
            return
        hosts = [socket.gethostname()] * world_size
        if world_size > 1:
            dist.all_gather_object(hosts, socket.gethostname())
        if len(set(hosts)) > 1:
            raise ckpt.CheckpointError(
                f"--non-persistent-ckpt-type local needs every rank on one host, but this job runs on "
                f"{len(set(hosts))} ({', '.join(sorted(set(hosts)))}); each host's --non-persistent-local-ckpt-dir "
                "would hold only its own ranks' files: use --save alone (with --async-save) on a shared file system")
        os.makedirs(self.dir, exist_ok=True)

    def after_step(self, trainer, iteration: int, persistent_saved: bool) -> None:
        """Save to the local directory every `interval` iterations, unless --save has just saved this one."""
        if not self.interval or iteration % self.interval or persistent_saved:
            return
        trainer.log.flush(trainer.progress)  # the saved nan count includes every iteration run
        start = time.monotonic()
        tag = ckpt.save_checkpoint(self.dir, iteration, self.state, trainer.model, trainer.optimizer,
                                   trainer.client_state(), async_save=self.async_save, keep_last_k=1,
                                   converters=trainer.converters)
        directory, seconds = os.path.join(self.dir, tag), time.monotonic() - start
        trainer._log("local tier: " + (async_started_line(directory, seconds) if self.async_save else
                                       saved_line(directory, seconds, None)))
