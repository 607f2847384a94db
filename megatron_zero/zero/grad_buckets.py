"""Gradient buckets of ZeRO stages 0-2: where each gradient goes, when a bucket is complete, and the one
collective that reduces it (Megatron's distributed-optimizer buckets, on DeepSpeed's partition layout).

A bucket (partition.BucketLayout) is ``dp`` rows of one width; row r holds the gradient elements of
rank r's partition that the bucket covers. ``add(key, grad)`` adds a parameter's gradient into the rows
through offsets computed once (one ``add_`` per piece: no loop over ranks, no packing), ``ready(key)``
counts the bucket's parameters down and launches it when the last is in:

    stage 1/2: reduce_scatter_tensor(this rank's piece of its fp32 gradient partition, the rows)
    stage 0:   all_reduce(the rows), in place (every rank keeps whole gradients)

Rows are held one of two ways:

    persistent (stages 0/1, gradient-accumulation fusion on): one fp32 buffer per group in the flat parameter
        order (Megatron's fp32 main_grad, DeepSpeed's partition layout), accumulating every micro-batch; rank
        r's partition is the buffer's [r P, (r + 1) P), so this rank's fp32 gradient partition is a view of
        the buffer, not a second tensor (Megatron's distributed optimizer: 4 bytes of gradient a parameter,
        not 4 + 4 / dp). A bucket (partition.strided_buckets) is the same stretch of every partition: its rows
        are a strided view of the buffer, copied into one contiguous input when the bucket is reduced (at
        most MAX_IN_FLIGHT + 1 buckets' worth at once), and the reduce-scatter writes this rank's sum over its
        own row of the buffer. With one partition the rows are contiguous and nothing is copied.
    transient (stage 2; stages 0/1 with --no-gradient-accumulation-fusion): a bucket's rows are allocated at
        its first gradient and freed once its result is added into the partition.

Blocking collectives go through shm_comm (shared memory where the group's ranks share one host on gloo,
torch.distributed's otherwise); async ones (``async_op``: --overlap-grad-reduce) are torch.distributed's,
at most MAX_IN_FLIGHT under way, landed in launch order, so results are added in the same order either way.
``reduce_dtype`` bfloat16 (--grad-reduce-in-bf16) casts a bucket's rows for the collective only; the
accumulation stays fp32.

``to_host`` (an offloaded optimizer, host_grads.py): the partitions are host tensors; each bucket is reduced
on the device as above (persistent: onto this rank's own row of the buffer) and its sum goes down to the
host as it lands, added into (persistent: copied over) the partition there. The device holds no fp32
partition of its own (stage 2: only the open buckets; stages 0/1 keep the accumulation buffer).
"""
from __future__ import annotations

from collections import deque
from typing import Dict, List, Sequence, Tuple

import torch
import torch.distributed as dist

from ..distributed import shm_comm
from ..distributed.reduce_scatter import reduce_scatter_tensor
from .host_grads import HostGradients
from .partition import BucketLayout, GroupPartition

MAX_IN_FLIGHT = 2


class _Bucket:
    __slots__ = ("gi", "layout", "rows", "pending", "launched", "numel")

    def __init__(self, gi: int, layout: BucketLayout, rows):
        self.gi, self.layout, self.rows, self.launched = gi, layout, rows, False
        self.pending = len(layout.params)
        self.numel = sum(n for _, _, _, n in layout.pieces)


class GradBuckets:
    def __init__(self, parts: Sequence[GroupPartition], layouts: Sequence[Sequence[BucketLayout]], rank: int,
                 group, reduce_dp: int, device: torch.device, persistent: bool, async_op: bool = False,
                 reduce_dtype: torch.dtype = torch.float32, to_host: bool = False):
        self.dp = parts[0].dp if parts else 1
        self.rank, self.group, self.reduce_dp, self.device = rank, group, reduce_dp, device
        self.persistent, self.async_op, self.reduce_dtype = persistent, async_op, reduce_dtype
        self.buckets: List[_Bucket] = []
        self.buffers: List[torch.Tensor] = []
        # (group, param index) -> [(bucket, ((offset in param, offset in rows, numel), ...))]
        self.routes: Dict[Tuple[int, int], List[Tuple[_Bucket, tuple]]] = {}
        self.offsets = [part.offsets for part in parts]
        for gi, group_layouts in enumerate(layouts):
            part = parts[gi]
            buffer = torch.zeros(part.padded_numel, device=device) if persistent else None
            for lay in group_layouts:
                rows = None
                if persistent:  # strided buckets: the same stretch [lo, hi) of every partition
                    if len(set(lay.lo)) != 1 or len(set(lay.hi)) != 1:
                        raise ValueError("a persistent gradient buffer takes strided buckets (partition.strided_buckets)")
                    rows = buffer.view(self.dp, part.partition_size)[:, lay.lo[0]:lay.hi[0]]
                bucket = _Bucket(gi, lay, rows)
                self.buckets.append(bucket)
                pieces: Dict[int, list] = {}
                for i, a, o, n in lay.pieces:
                    pieces.setdefault(i, []).append((a, o, n))
                for i, ps in pieces.items():
                    self.routes.setdefault((gi, i), []).append((bucket, tuple(ps)))
            self.buffers.append(buffer)
        # this rank's fp32 gradient partitions: its stretch of the persistent buffer, or tensors of their own
        # (on the host with to_host; the reduce-scatters still land on the device: `device_parts`)
        own = [b[slice(*p.bounds(rank))] for b, p in zip(self.buffers, parts)] if persistent else None
        self.host = None
        if to_host:
            widths = [lay.width for group_layouts in layouts for lay in group_layouts]
            self.host = HostGradients([p.partition_size for p in parts], device, max(widths, default=1))
            self.partitions = self.host.partitions
        else:
            self.partitions = own if persistent else [torch.zeros(p.partition_size, device=device) for p in parts]
        self.device_parts = own if persistent else self.partitions
        self._in_flight = deque()
        self.held_numel = 0  # gradient elements in transient rows not yet reduced
        self.staged_numel = 0  # elements of persistent buckets' contiguous copies under way
        self.peak_numel = 0

    # ---- filling -------------------------------------------------------------------------
    def add(self, key: Tuple[int, int], grad: torch.Tensor) -> None:
        """Add one parameter's gradient into its buckets' rows."""
        flat = grad.detach().reshape(-1)
        if self.persistent:  # the buffer is in parameter order: one add
            gi, i = key
            off = self.offsets[gi][i]
            self.buffers[gi][off:off + flat.numel()].add_(flat)
            return
        for bucket, pieces in self.routes.get(key, ()):
            if bucket.rows is None:
                bucket.rows = torch.zeros(self.dp * bucket.layout.width, device=self.device)
                self.held_numel += bucket.numel
                self.peak_numel = max(self.peak_numel, self.held_numel)
            for a, o, n in pieces:
                bucket.rows[o:o + n].add_(flat[a:a + n])

    def ready(self, key: Tuple[int, int]) -> None:
        """The parameter's gradient is all in: launch each of its buckets that this completes."""
        for bucket, _ in self.routes.get(key, ()):
            bucket.pending -= 1
            if bucket.pending <= 0 and not bucket.launched:
                self._launch(bucket)

    def launch_remaining(self, keep=lambda bucket: False) -> None:
        """Launch every bucket holding gradients not yet reduced (in bucket order, the same on every rank)
        except those `keep` names (async ones stay under way: land_all waits)."""
        for bucket in self.buckets:
            if bucket.rows is not None and not bucket.launched and not keep(bucket):
                self._launch(bucket)

    def keys_of(self, bucket: _Bucket):
        return [(bucket.gi, i) for i in bucket.layout.params]

    # ---- reducing ------------------------------------------------------------------------
    def _launch(self, bucket: _Bucket) -> None:
        lay, rows = bucket.layout, bucket.rows
        bucket.pending = len(lay.params)
        if self.persistent:
            bucket.launched = True
        else:
            bucket.rows = None
            self.held_numel -= bucket.numel
        lo, hi = lay.lo[self.rank], lay.hi[self.rank]
        target = self.device_parts[bucket.gi][lo:hi]  # (to_host, transient: the host partition, read at landing)
        if self.persistent:  # [dp, width] rows of the buffer: one contiguous input (a copy where dp > 1)
            data = rows.reshape(-1) if self.reduce_dtype == rows.dtype else rows.to(self.reduce_dtype).reshape(-1)
            if self.dp > 1 and data.data_ptr() == rows.data_ptr():
                data = data.clone()  # one bucket spanning whole partitions: the collective must not read its output
            if data.data_ptr() != rows.data_ptr():
                self.staged_numel += data.numel()
                self.peak_numel = max(self.peak_numel, self.held_numel + self.staged_numel)
        else:
            data = rows if self.reduce_dtype == rows.dtype else rows.to(self.reduce_dtype)
        work = None
        if self.dp > 1:
            # persistent: the result lands on this rank's own row of the buffer, which the input was copied from
            direct = self.persistent and data.dtype == target.dtype
            result = target if direct else torch.empty(lay.width, dtype=data.dtype, device=self.device)
            work = self._reduce_scatter(result, data)
        else:
            result = data
            if self.reduce_dp > 1:
                work = self._all_reduce(data)
        # what the collective reads and writes stays referenced until it has landed
        host = self.partitions[bucket.gi][lo:hi] if self.host is not None else None
        self._in_flight.append((work, result, target, data, host))
        while len(self._in_flight) > (MAX_IN_FLIGHT if self.async_op else 0):
            self._land_oldest()

    def _reduce_scatter(self, out, rows):
        if self.async_op:
            return reduce_scatter_tensor(out, rows, group=self.group, async_op=True)
        shm_comm.reduce_scatter_tensor(out, rows, self.group)

    def _all_reduce(self, rows):
        if self.async_op:
            return dist.all_reduce(rows, group=self.group, async_op=True)
        shm_comm.all_reduce(rows, self.group)

    def _land_oldest(self) -> None:
        work, result, target, data, host = self._in_flight.popleft()
        if work is not None:
            work.wait()
        if self.persistent and data.data_ptr() != target.data_ptr():
            self.staged_numel -= data.numel()
        n = target.numel()
        if host is not None:  # the sum goes down to the host partition (persistent: it is the whole sum)
            self.host.put(result[:n], [(host, 0, n)], accumulate=not self.persistent)
            return
        if n == 0 or (result.data_ptr() == target.data_ptr() and result.dtype == target.dtype):
            return  # nothing of this bucket is mine, or it was reduced in place
        if self.persistent:
            target.copy_(result[:n])  # reduced once per step, into a zeroed partition (or its own rows)
        else:
            target.add_(result[:n])

    def land_all(self) -> None:
        """Every launched bucket reduced and added into the partitions (to_host: on the host)."""
        while self._in_flight:
            self._land_oldest()
        if self.host is not None:
            self.host.flush()

    # ---- accounting and reset --------------------------------------------------------------
    def held_bytes(self) -> int:
        """Bytes of every gradient tensor held on the device: buffers, partitions, open rows, collectives under
        way (to_host: the partitions are host_bytes())."""
        seen, total = set(), 0
        tensors = [b for b in self.buffers if b is not None] + (self.partitions if self.host is None else []) + [
            b.rows for b in self.buckets if b.rows is not None and not self.persistent]
        for _, result, _, data, _ in self._in_flight:
            tensors += [result, data]
        for t in tensors:  # views of a buffer counted once, with the buffer
            storage = t.untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
        return total

    def host_bytes(self) -> int:
        """Bytes of gradients held on the host (to_host): the partitions and the slots they come down through."""
        return self.host.held_bytes() if self.host is not None else 0

    def zero(self) -> None:
        """Before the next global batch: nothing launched, every count full, every sum zero."""
        self.land_all()
        for bucket in self.buckets:
            bucket.pending, bucket.launched = len(bucket.layout.params), False
            if not self.persistent:
                bucket.rows = None
        self.held_numel = 0
        for t in self.partitions + [b for b in self.buffers if b is not None]:
            t.zero_()

    def reset_counts(self) -> None:
        for bucket in self.buckets:
            bucket.pending = len(bucket.layout.params)
