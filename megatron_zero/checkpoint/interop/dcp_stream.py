"""torch.distributed.checkpoint directories written one chunk at a time: the host holds one chunk, never the state.

    chunks = [Chunk("layers.w", (3,), (L, h, h)), Chunk("norm.weight", (), (h,)), ...]
    save_streamed(directory, chunks, blobs, produce, on_written=None)

`produce(fqn, index)` returns the chunk `index` of the leading dimensions of tensor `fqn` (the whole tensor for
index ()) when the writer needs it; `blobs` are byte objects (DCP's BYTE_IO items: what DCP writes for a value that
is not a tensor, e.g. an int as `torch.save`d bytes). The plan is made from shapes alone (`StreamingPlanner`),
and `StreamingWriter` writes each chunk as torch's FileSystemWriter does (a `torch.save` of the tensor at an
offset of `__0_0.distcp`, recorded in `.metadata`, which torch's FileSystemReader and Megatron-Core read) but
drops it once written: torch 2.13's writer keeps every tensor of a file referenced until the file is closed (it
collects them for its safetensors format), so a whole-model save held the whole model.
"""
from __future__ import annotations

import io
import os
import warnings

from typing import Callable, Dict, List, NamedTuple, Optional, Tuple

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo  # the record .metadata holds per item
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future


class Chunk(NamedTuple):
    fqn: str
    index: Tuple[int, ...]  # the chunk is [index] of the leading dimensions; () is the whole tensor
    global_size: Tuple[int, ...]
    dtype: torch.dtype = torch.float32


class StreamingPlanner(DefaultSavePlanner):
    """Plans from the chunks' shapes alone; `produce(fqn, index)` makes a chunk when the writer asks for it."""

    def __init__(self, chunks: List[Chunk], blobs: Dict[str, bytes], produce: Callable):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False, dedup_save_to_lowest_rank=False)
        self.chunks, self.blobs, self.produce = chunks, blobs, produce

    def create_local_plan(self) -> SavePlan:
        items, self.index_of = [], {}
        for c in self.chunks:
            offsets, sizes = [0] * len(c.global_size), list(c.global_size)
            for dim, i in enumerate(c.index):
                offsets[dim], sizes[dim] = i, 1
            self.index_of[(c.fqn, tuple(offsets))] = c.index
            items.append(WriteItem(index=MetadataIndex(c.fqn, torch.Size(offsets)),
                                   type=WriteItemType.SHARD if c.index else WriteItemType.TENSOR,
                                   tensor_data=TensorWriteData(ChunkStorageMetadata(torch.Size(offsets),
                                                                                    torch.Size(sizes)),
                                                               TensorProperties(dtype=c.dtype),
                                                               torch.Size(c.global_size))))
        items += [WriteItem(index=MetadataIndex(fqn), type=WriteItemType.BYTE_IO) for fqn in self.blobs]
        self.plan = SavePlan(items)
        return self.plan

    def resolve_data(self, write_item: WriteItem):
        fqn = write_item.index.fqn
        if write_item.type == WriteItemType.BYTE_IO:
            return io.BytesIO(self.blobs[fqn])
        return self.produce(fqn, self.index_of[(fqn, tuple(write_item.index.offset))])


class StreamingWriter(dcp.FileSystemWriter):
    """FileSystemWriter's single-file layout, each item dropped as soon as it is in the file."""

    def __init__(self, path: str, on_written: Optional[Callable[[str, int], None]] = None):
        super().__init__(path, single_file_per_rank=True, thread_count=1)
        self.on_written = on_written

    def write_data(self, plan: SavePlan, planner: StreamingPlanner) -> Future:
        name = f"{plan.storage_data.prefix}0.distcp"
        results = []
        with open(os.path.join(self.path, name), "wb") as f:
            for item in plan.items:
                offset = f.tell()
                data = planner.resolve_data(item)
                if item.type == WriteItemType.BYTE_IO:
                    f.write(data.getbuffer())
                else:
                    data = data.detach()
                    if data.untyped_storage().nbytes() != data.nbytes:  # a view: save its own bytes only
                        data = data.clone()
                    torch.save(data, f)
                length = f.tell() - offset
                del data
                results.append(WriteResult(index=item.index, size_in_bytes=length,
                                           storage_data=_StorageInfo(name, offset, length)))
                if self.on_written is not None and item.type != WriteItemType.BYTE_IO:
                    self.on_written(item.index.fqn, length)
            f.flush()
            if self.sync_files:
                os.fsync(f.fileno())
        done: Future = Future()
        done.set_result(results)
        return done


def save_streamed(directory: str, chunks: List[Chunk], blobs: Dict[str, bytes], produce: Callable,
                  on_written: Optional[Callable[[str, int], None]] = None) -> None:
    """Write `directory` (created) as a one-process DCP checkpoint of `chunks` and `blobs`; on_written(fqn, bytes)
    after each tensor."""
    os.makedirs(directory, exist_ok=True)
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({}, storage_writer=StreamingWriter(directory, on_written),
                 planner=StreamingPlanner(chunks, blobs, produce), no_dist=True)


def object_bytes(value) -> bytes:
    """A value that is not a tensor as DCP stores it (BYTE_IO: its torch.save bytes)."""
    buf = io.BytesIO()
    torch.save(value, buf)
    return buf.getvalue()
