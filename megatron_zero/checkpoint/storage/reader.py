"""Open a checkpoint directory and read the files asked for: safely unpickled, verified while read.

    ckpt = open_checkpoint(load_dir)            # tag from `latest`; manifest + sizes checked
    ckpt = open_directory("<save>/global_step6")   # one checkpoint (or universal) directory
    sd = ckpt.load("mp_rank_00_model_states.pt")   # checksum checked as it is read, then unpickled

Every reader of a checkpoint (same-layout and reshaped loads, universal conversion and loading,
consolidation, HF export) reads through `Checkpoint.load`. A directory with a manifest has every
file's size checked when opened and each file's checksum checked as it is read (once per file per
process); a file the manifest does not list is refused. A directory without one (DeepSpeed writes
none) is read unverified after one warning. `verify=False` (the tools' and pretrain's
--no-verify-checkpoint) skips both.
"""
from __future__ import annotations

import os
import sys
from typing import Any, Optional

from ...config.checkpointing import add_verify_flag  # noqa: F401 (the tools' import of it)
from .commit import read_latest
from ..errors import CheckpointError
from .manifest import MANIFEST, read_manifest, verify_sizes
from .tensor_io import load_file, verify_file

_WARNED = set()


def _warn_once(directory: str) -> None:
    import torch.distributed as dist

    if directory in _WARNED:
        return
    _WARNED.add(directory)
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(f"warning: {directory} has no {MANIFEST} (it was not written by megatron_zero, e.g. by DeepSpeed), "
              "so its files are read without checksum verification", file=sys.stderr, flush=True)


class Checkpoint:
    def __init__(self, directory: str, manifest: Optional[dict]):
        self.directory, self.manifest = directory, manifest
        self.tag = os.path.basename(os.path.normpath(directory))
        self._verified = set()

    def path(self, name: str) -> str:
        return os.path.join(self.directory, name)

    def has(self, name: str) -> bool:
        if self.manifest is not None:
            return name in self.manifest["files"]
        return os.path.exists(self.path(name))

    def require(self, name: str, why: str = "") -> None:
        if not self.has(name):
            raise CheckpointError(f"the checkpoint file {self.path(name)} is missing{(' (' + why + ')') if why else ''}")

    def _checksum(self, name: str) -> Optional[str]:
        """The checksum still to verify for `name` (None: no manifest, or verified already)."""
        if self.manifest is None or name in self._verified:
            return None
        info = self.manifest["files"].get(name)
        if info is None:
            raise CheckpointError(f"the checkpoint file {self.path(name)} is not listed in the manifest of "
                                  f"{self.directory}")
        return info["checksum"]

    def load(self, name: str, mmap: bool = True, device=None) -> Any:
        """The unpickled file `name`, its tensors on `device` (default the CPU); with a manifest, its
        checksum is verified as it is read."""
        obj = load_file(self.path(name), mmap=mmap, checksum=self._checksum(name), device=device)
        self._verified.add(name)
        return obj

    def verify(self, names) -> None:
        """Verify `names` now (once each), e.g. before forked workers, which share nothing back, read them."""
        for name in names:
            checksum = self._checksum(name)
            if checksum is not None:
                verify_file(self.path(name), checksum)
            self._verified.add(name)

    @property
    def meta(self) -> dict:
        return {} if self.manifest is None else {k: v for k, v in self.manifest.items() if k != "files"}


def open_directory(directory: str, verify: bool = True) -> Checkpoint:
    """One checkpoint directory, its manifest read and sizes checked (verify=False: neither)."""
    if not os.path.isdir(directory):
        raise CheckpointError(f"the checkpoint directory {directory} does not exist")
    manifest = read_manifest(directory) if verify else None
    if manifest is not None:
        verify_sizes(directory, manifest)
    elif verify:
        _warn_once(directory)
    return Checkpoint(directory, manifest)


def open_checkpoint(load_dir: str, tag: Optional[str] = None, verify: bool = True) -> Checkpoint:
    """The checkpoint `tag` (default: the one `latest` names) under load_dir, its manifest and sizes checked."""
    if not os.path.isdir(load_dir):
        raise CheckpointError(f"the checkpoint directory {load_dir} does not exist")
    tag = tag or read_latest(load_dir)
    directory = os.path.join(load_dir, tag)
    if not os.path.isdir(directory):
        raise CheckpointError(f"the checkpoint directory {directory} (named by {os.path.join(load_dir, 'latest')}) "
                              "does not exist")
    return open_directory(directory, verify)
