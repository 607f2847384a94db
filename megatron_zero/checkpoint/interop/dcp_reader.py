"""Tensors out of a torch.distributed.checkpoint directory with torch's public reader, one at a time.

    r = DcpReader(directory)        # reads .metadata only
    r.shape("a.weight")             # torch.Size, or None when the checkpoint has no such tensor
    r.read("a.weight")              # the whole tensor (global shape), fp32 or as saved
    r.read("layers.w", index=3)     # only [3] of a tensor stacked on dim 0: the saved chunks overlapping it
    r.read("experts.w", (3, 1))     # only [3, 1] of a tensor stacked on dims 0 and 1 (layers, experts)
    r.read_object("train_state.step")   # a value saved as bytes (not a tensor), through the safe unpickler

No process group is needed or used (`no_dist=True`): each caller reads the keys it needs, which is what
lets every rank of a run read only its own parameters. A slice is planned with torch's public
`create_read_items_for_chunk_list`, so only the saved chunks that overlap it are read from disk.
"""
from __future__ import annotations

import io
import warnings
from typing import Any, Optional, Tuple, Union

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, MetadataIndex,
                                                   TensorStorageMetadata)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from ..errors import CheckpointError


class _ChunkPlanner(DefaultLoadPlanner):
    """Plans the reads of one chunk (offsets, sizes) of each named tensor into a tensor of the chunk's size."""

    def __init__(self, chunks: dict):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.chunks = chunks

    def create_local_plan(self) -> LoadPlan:
        items = []
        for fqn, chunk in self.chunks.items():
            items += create_read_items_for_chunk_list(fqn, self.metadata.state_dict_metadata[fqn], [chunk])
        return LoadPlan(items)

    def lookup_tensor(self, index):
        return self.state_dict[index.fqn]  # the chunk's own tensor: read items' dest offsets are relative to it


class _BytesPlanner(DefaultLoadPlanner):
    """Plans the read of one BYTE_IO item and keeps its bytes (unpickled by the caller, safely)."""

    def __init__(self, fqn: str):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.fqn, self.data = fqn, None

    def create_local_plan(self) -> LoadPlan:
        zero = torch.Size((0,))
        return LoadPlan([ReadItem(type=LoadItemType.BYTE_IO, dest_index=MetadataIndex(self.fqn), dest_offsets=zero,
                                  storage_index=MetadataIndex(self.fqn), storage_offsets=zero, lengths=zero)])

    def load_bytes(self, read_item, value) -> None:
        self.data = value.read()


class DcpReader:
    def __init__(self, directory: str):
        self.directory = directory
        try:
            self.storage = dcp.FileSystemReader(directory)
            self.metadata = self.storage.read_metadata()
        except Exception as e:  # a missing or unreadable .metadata: torch raises several kinds
            raise CheckpointError(f"{directory} is not a readable torch.distributed.checkpoint directory "
                                  f"({type(e).__name__}: {e})") from e
        self.tensors = {k: v for k, v in self.metadata.state_dict_metadata.items()
                        if isinstance(v, TensorStorageMetadata)}
        self.objects = {k for k, v in self.metadata.state_dict_metadata.items() if isinstance(v, BytesStorageMetadata)}

    def read_object(self, fqn: str) -> Any:
        """A value DCP saved as bytes (an int, a dict, ...), unpickled with the safe loader."""
        from ..storage.safe_pickle import RefusedGlobal, safe_load
        if fqn not in self.objects:
            raise CheckpointError(f"{self.directory} holds no value {fqn}")
        planner = _BytesPlanner(fqn)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            dcp.load({}, storage_reader=self.storage, planner=planner, no_dist=True)
        try:
            return safe_load(io.BytesIO(planner.data), where=f"{self.directory}'s {fqn}")
        except RefusedGlobal as e:
            raise CheckpointError(str(e)) from None

    def shape(self, fqn: str) -> Optional[torch.Size]:
        md = self.tensors.get(fqn)
        return None if md is None else md.size

    def read(self, fqn: str, index: Union[None, int, Tuple[int, ...]] = None) -> torch.Tensor:
        md = self.tensors.get(fqn)
        if md is None:
            raise CheckpointError(f"{self.directory} holds no tensor {fqn}")
        index = () if index is None else (index,) if isinstance(index, int) else tuple(index)
        size = list(md.size)
        offsets = [0] * len(size)
        for dim, i in enumerate(index):
            if not 0 <= i < size[dim]:
                raise CheckpointError(f"{self.directory}: {fqn} stacks {size[dim]} entries on dim {dim}, not {i + 1}")
            offsets[dim], size[dim] = i, 1
        out = torch.empty(size, dtype=md.properties.dtype)
        chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(size))
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.simplefilter("ignore", UserWarning)
            dcp.load({fqn: out}, storage_reader=self.storage, planner=_ChunkPlanner({fqn: chunk}),
                     no_dist=True)
        return out.reshape(size[len(index):])
