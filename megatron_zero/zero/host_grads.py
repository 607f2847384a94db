"""ZeRO-Offload's gradients: the reduced fp32 gradient partition held in host memory, not on the device.

Under --cpu-optimizer (and NVMe offload) the CPU Adam steps host masters with host gradients, so the
device need not hold the fp32 gradient partition at all (DeepSpeed's ZeRO-Offload: its reduced
gradients go to the host as each bucket is reduced). ``HostGradients`` holds each param group's
partition in host memory (pinned when the device is a GPU) and takes each reduced bucket as it lands:

    copy stream:  bucket 0 down | bucket 1 down | ...
    host:                       | add bucket 0's pieces | add bucket 1's pieces | ...

``put(src, pieces)`` queues the copy of `src` (the device's reduced bucket, fp32) into one of SLOTS
host buffers of the bucket size (`slot_numel`, grown for a larger bucket), non-blocking on a side copy stream after the work that
produced it, and keeps `src` referenced until it has landed; each piece (a host partition's view, an
offset in `src`, accumulate or not) is then added into (or copied over) its partition on the host. The
host waits for a copy only when its slot is needed again or at ``flush()`` (before the step reads the
partitions), in the order the buckets were put, so the sums are the device path's, bit for bit. On the
CPU (no stream, plain copies) the same ring runs with the copies done when issued.

Device bytes saved: the partition (4 bytes per element of this rank's share); host bytes added: the
partition and SLOTS buffers (what zero/offload.py staged the gradients in before, less its slots).
"""
from __future__ import annotations

from collections import deque
from typing import List, Sequence, Tuple

import torch

from ..distributed.device import copy_stream, host_empty, on_stream, record_event, wait_event

SLOTS = 2  # host buffers reduced buckets come down through, in turn

Piece = Tuple[torch.Tensor, int, int]  # (host target, offset in the bucket, numel)


class HostGradients:
    def __init__(self, sizes: Sequence[int], device: torch.device, slot_numel: int):
        self.device = device
        self.partitions: List[torch.Tensor] = [host_empty(n, torch.float32, device).zero_() for n in sizes]
        self.slot_numel = max(1, int(slot_numel))
        self.stream = copy_stream(device)
        self._slots: List[torch.Tensor | None] = [None] * SLOTS
        self._pending = deque()  # (event, slot, src, pieces, accumulate), oldest first
        self._count = 0  # buckets put so far (slot k = count % SLOTS)

    def put(self, src: torch.Tensor, pieces: Sequence[Piece], accumulate: bool = True) -> None:
        """Bring the reduced bucket `src` (1-D, on the device) down and add (or copy, `accumulate` False)
        each piece's stretch of it into its host target."""
        pieces = [p for p in pieces if p[2] > 0]
        if not pieces:
            return
        if src.dtype != torch.float32:  # --grad-reduce-in-bf16: the sums are fp32
            src = src.float()
        while len(self._pending) >= SLOTS:  # the oldest holds the slot this bucket takes
            self._land_oldest()
        k = self._count % SLOTS
        self._count += 1
        if self._slots[k] is None or self._slots[k].numel() < src.numel():  # (a bucket past the usual size:
            self._slots[k] = host_empty(max(self.slot_numel, src.numel()), torch.float32, self.device)  # ZeRO-3's)
        slot = self._slots[k][:src.numel()]
        with on_stream(self.stream, self.device):  # after the reduction that wrote src
            slot.copy_(src, non_blocking=True)
            event = record_event(self.stream)
        self._pending.append((event, slot, src, pieces, accumulate))

    def _land_oldest(self) -> None:
        event, slot, _src, pieces, accumulate = self._pending.popleft()
        wait_event(event)
        for target, offset, n in pieces:
            if accumulate:
                target.add_(slot[offset:offset + n])
            else:
                target.copy_(slot[offset:offset + n])

    def flush(self) -> None:
        """Every bucket put so far added into the partitions (the host waits for their copies)."""
        while self._pending:
            self._land_oldest()

    def zero(self) -> None:
        self.flush()
        for p in self.partitions:
            p.zero_()

    def held_bytes(self) -> int:
        """Host bytes: the partitions and the slots allocated."""
        return sum(t.numel() * 4 for t in self.partitions) + sum(s.numel() * 4 for s in self._slots if s is not None)
