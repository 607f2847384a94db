"""Find and open a committed checkpoint, reading only the files asked for, verified.

    ckpt = open_checkpoint(load_dir)            # tag from `latest`; manifest + sizes checked
    sd = ckpt.load("mp_rank_00_model_states.pt")   # checksum checked, then torch.load(mmap=True)
"""
from __future__ import annotations

import os
from typing import Any, Optional

from .commit import read_latest
from .errors import CheckpointError
from .manifest import read_manifest, verify_checksums, verify_sizes
from .tensor_io import load_file


class Checkpoint:
    def __init__(self, directory: str, manifest: Optional[dict]):
        self.directory, self.manifest = directory, manifest
        self.tag = os.path.basename(os.path.normpath(directory))

    def path(self, name: str) -> str:
        return os.path.join(self.directory, name)

    def has(self, name: str) -> bool:
        if self.manifest is not None:
            return name in self.manifest["files"]
        return os.path.exists(self.path(name))

    def require(self, name: str, why: str = "") -> None:
        if not self.has(name):
            raise CheckpointError(f"the checkpoint file {self.path(name)} is missing{(' (' + why + ')') if why else ''}")

    def load(self, name: str, mmap: bool = True) -> Any:
        self.require(name)
        if self.manifest is not None:
            verify_checksums(self.directory, self.manifest, [name])
        return load_file(self.path(name), mmap=mmap)

    @property
    def meta(self) -> dict:
        return {} if self.manifest is None else {k: v for k, v in self.manifest.items() if k != "files"}


def open_checkpoint(load_dir: str, tag: Optional[str] = None, verify: bool = True) -> Checkpoint:
    """The checkpoint `tag` (default: the one `latest` names) under load_dir, its manifest and sizes checked."""
    if not os.path.isdir(load_dir):
        raise CheckpointError(f"the checkpoint directory {load_dir} does not exist")
    tag = tag or read_latest(load_dir)
    directory = os.path.join(load_dir, tag)
    if not os.path.isdir(directory):
        raise CheckpointError(f"the checkpoint directory {directory} (named by {os.path.join(load_dir, 'latest')}) "
                              "does not exist")
    manifest = read_manifest(directory, required=verify)
    if manifest is not None:
        verify_sizes(directory, manifest)
    return Checkpoint(directory, manifest)
