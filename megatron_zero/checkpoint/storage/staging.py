"""The bounded host buffer a tensor's bytes pass through on their way from the device to a file.

    staging = HostStaging()                  # 256 MiB by default, allocated on first use, reused
    for view in staging.chunks(tensor):      # host memoryviews, in order, each valid until the next
        os.write(fd, view)

A tensor on a GPU is copied into a ring of fixed-size slots of one host buffer (pinned, so the
copies are `non_blocking` on a side stream of the device object's): while the file gets slot i,
the copies into the following slots are in flight. A tensor of any size goes through in pieces,
so the host memory a save needs to move device tensors is the buffer, `nbytes`, whatever the
size of the state or of its largest tensor. A host tensor (a CPU run) is handed out as views of
its own memory, without a copy; `copy_host_tensors=True` sends it through the ring as well, which
is how the tests measure the ring's bound on a machine without a GPU (the same code, a different
device). Owns the buffer and the copy stream; knows nothing of files or formats.
"""
from __future__ import annotations

import threading
from collections import deque
from typing import Iterator, Optional

import torch

from ...distributed.device import HOST, copy_stream, host_empty, on_stream, record_event, wait_event

DEFAULT_STAGING_BYTES = 256 << 20
CHUNK_BYTES = 8 << 20
_DEFAULT: Optional["HostStaging"] = None


class HostStaging:
    def __init__(self, nbytes: int = DEFAULT_STAGING_BYTES, chunk_bytes: int = CHUNK_BYTES,
                 copy_host_tensors: bool = False):
        if nbytes < chunk_bytes or chunk_bytes <= 0:
            raise ValueError(f"a staging buffer of {nbytes} bytes cannot hold one {chunk_bytes}-byte chunk")
        self.nbytes, self.chunk_bytes, self.copy_host_tensors = nbytes, chunk_bytes, copy_host_tensors
        self._device: Optional[torch.device] = None
        self._slots = []
        self._stream = None
        self._lock = threading.Lock()  # one file at a time uses the ring (an async save's thread, or the caller)

    def _ring(self, device: torch.device):
        if self._device != device:
            buf = host_empty(self.nbytes - self.nbytes % self.chunk_bytes, torch.uint8, device)
            self._slots = list(buf.split(self.chunk_bytes))
            self._stream, self._device = copy_stream(device), device
        return self._slots

    def chunks(self, tensor: torch.Tensor) -> Iterator[memoryview]:
        """`tensor`'s bytes (C order) as host memoryviews of at most chunk_bytes, in order."""
        flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)  # non-contiguous: copied on its device
        n = flat.numel()
        if flat.device.type == HOST.type and not self.copy_host_tensors:
            mv = memoryview(flat.numpy())
            for off in range(0, n, self.chunk_bytes):
                yield mv[off:off + self.chunk_bytes]
            return
        with self._lock:
            yield from self._staged(flat, n)

    def _staged(self, flat: torch.Tensor, n: int) -> Iterator[memoryview]:
        slots = self._ring(flat.device)
        stream = self._stream
        pending, issued, off = deque(), 0, 0
        while off < n or pending:
            with on_stream(stream, flat.device):  # the copies wait for the work that produced `flat`
                while off < n and len(pending) < len(slots):
                    k = min(self.chunk_bytes, n - off)
                    slot = slots[issued % len(slots)][:k]
                    slot.copy_(flat[off:off + k], non_blocking=True)
                    pending.append((slot, record_event(stream)))
                    issued, off = issued + 1, off + k
            slot, event = pending.popleft()
            wait_event(event)
            yield memoryview(slot.numpy())  # the slot is refilled only after the caller asks for the next


def default_staging() -> HostStaging:
    """The process's staging buffer (DEFAULT_STAGING_BYTES, allocated when a device tensor first needs it)."""
    global _DEFAULT
    if _DEFAULT is None:
        _DEFAULT = HostStaging()
    return _DEFAULT
