"""Where a step's tensors live, seen on the CPU: host memory vs the trainer's device, collectives, host syncs.

On the CPU the trainer's device and the host are the same memory, so a tensor that would sit in host
memory on a GPU machine (and crash an NCCL collective, or cost a host round trip) computes correctly
here. `PlacementTracker`, a TorchFunctionMode, tells them apart by how each tensor was made:

- *host* tensors: a factory call given `device=HOST` (distributed/device.py's host object: `host_empty`, the
  offloaded masters, checkpoint staging), `pin_memory=True`, or no device at all (torch's default
  device is the CPU whatever the trainer was given: also recorded as an unplaced call when megatron_zero
  code makes it); `torch.from_numpy` / `frombuffer`; `.cpu()`, `.pin_memory()`, `.to(HOST)`; and every
  result of an op whose tensor inputs are all host tensors. A host tensor's `.device` reads back as
  `HOST` itself, so a factory placed "beside" it (`device=t.device`) is a host tensor too.
- every other tensor is on the trainer's device. `.to(device)` of a host tensor is a new tensor
  (as it is on a GPU), never the host tensor itself.

The mark is kept per storage (its address, the storage held alive while the tracker lives), so views,
`Parameter` wrappers, `p.data = ...` and in-place writes keep it.

`watch_collectives(tracker)` wraps every torch.distributed collective and point-to-point call and the
shared-memory entry points (shm_comm, shm_p2p), wherever megatron_zero bound them, and records each
host tensor handed to one (`tracker.host_in_collective`). Every group of a run is device-bound (NCCL
on a GPU); object collectives take objects, not tensors, and are not checked.

`tracker.syncs` lists each host read of a device tensor (`item`, `tolist`, `bool()`, `float()`,
`int()`, `.cpu()`, `.to(HOST)`, `numpy`, `equal`, printing), with the megatron_zero line that did it:
on a GPU each one waits for the device's queued work.
"""
from __future__ import annotations

import sys
from contextlib import contextmanager
from typing import List

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

from ..distributed.device import HOST

FACTORIES = {torch.empty, torch.zeros, torch.ones, torch.full, torch.arange, torch.tensor, torch.as_tensor,
             torch.randn, torch.rand, torch.randint, torch.randperm, torch.empty_strided, torch.linspace,
             torch.eye, torch.scalar_tensor}
HOST_FACTORIES = {torch.from_numpy, torch.frombuffer}
TO_HOST = {torch.Tensor.cpu, torch.Tensor.pin_memory, torch.Tensor.numpy}
SYNCS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__bool__, torch.Tensor.__float__,
         torch.Tensor.__int__, torch.Tensor.__index__, torch.Tensor.numpy, torch.Tensor.cpu, torch.equal,
         torch.Tensor.equal, torch.allclose, torch.Tensor.allclose, torch.is_nonzero, torch.Tensor.__format__,
         torch.Tensor.__repr__}
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor",
               "broadcast", "reduce", "gather", "scatter", "all_to_all", "all_to_all_single", "send", "recv",
               "isend", "irecv", "batch_isend_irecv")


def _tensors(obj) -> List[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for o in obj for t in _tensors(o)]
    if isinstance(obj, dict):
        return [t for o in obj.values() for t in _tensors(o)]
    if isinstance(obj, dist.P2POp):
        return [obj.tensor]
    return []


def caller(skip_testing: bool = True) -> str:
    """'file:line' of the innermost megatron_zero frame outside this module (and the testing package)."""
    frame = sys._getframe(1)
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        if name.startswith("megatron_zero") and not (skip_testing and name.startswith("megatron_zero.testing")):
            return f"{frame.f_code.co_filename.split('megatron_zero/')[-1]}:{frame.f_lineno}"
        frame = frame.f_back
    return "<outside megatron_zero>"


class PlacementTracker(TorchFunctionMode):
    """Marks host tensors, counts factory calls made by megatron_zero, records host syncs (module docstring)."""

    def __init__(self):
        super().__init__()
        self.placed, self.unplaced = 0, []
        self.syncs: List[str] = []
        self.host_in_collective: List[str] = []
        self._host = {}  # storage address -> a tensor on that storage (keeps the address from being reused)

    # ---- the marks -------------------------------------------------------------------
    @staticmethod
    def _address(t: torch.Tensor) -> int:
        try:
            return t.untyped_storage().data_ptr()
        except (RuntimeError, NotImplementedError):  # no storage (sparse, meta)
            return 0

    def is_host(self, t: torch.Tensor) -> bool:
        address = self._address(t)
        return address != 0 and address in self._host

    def mark_host(self, out) -> None:
        for t in _tensors(out):
            address = self._address(t)
            if address:
                self._host[address] = t

    # ---- the mode ----------------------------------------------------------------------
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__self__", None) is torch.Tensor.device:  # the .device getter
            return HOST if self.is_host(args[0]) else func(*args, **kwargs)
        if func in SYNCS and args and isinstance(args[0], torch.Tensor) and not self.is_host(args[0]):
            self.syncs.append(f"{caller()} {func.__name__}")
        if func in FACTORIES:
            return self._factory(func, args, kwargs)
        out = func(*args, **kwargs)
        if func in HOST_FACTORIES or func in TO_HOST:
            self.mark_host(out)
        elif func is torch.Tensor.to:
            out = self._moved(args, kwargs, out)
        elif not (args and out is args[0]):  # in-place results keep their storage's mark
            inputs = _tensors(args) + _tensors(kwargs)
            if inputs and all(self.is_host(t) for t in inputs):
                self.mark_host(out)
        return out

    def _factory(self, func, args, kwargs):
        device = kwargs.get("device")
        frame = sys._getframe(2)  # the caller of the factory (torch's own internals are not ours to place)
        if frame.f_globals.get("__name__", "").startswith("megatron_zero"):
            if device is None:
                self.unplaced.append(f"{frame.f_code.co_filename}:{frame.f_lineno} {func.__name__}")
            else:
                self.placed += 1
        out = func(*args, **kwargs)
        if device is None or device is HOST or kwargs.get("pin_memory"):
            self.mark_host(out)
        return out

    def _moved(self, args, kwargs, out):
        """Tensor.to: to HOST marks the result; from a host tensor to anywhere else makes a new tensor."""
        target = kwargs.get("device")
        for a in args[1:]:
            if isinstance(a, (torch.device, str)):
                target = a
            elif isinstance(a, torch.Tensor):
                target = HOST if self.is_host(a) else a.device
        source = args[0]
        if target is None:
            if self.is_host(source):
                self.mark_host(out)
            return out
        if target is HOST:
            if not self.is_host(source):
                self.syncs.append(f"{caller()} to(HOST)")
            self.mark_host(out)
            return out
        if self.is_host(source) and self._address(out) == self._address(source):
            return out.clone()  # on a GPU this is a copy into device memory
        return out


@contextmanager
def watch_collectives(tracker: PlacementTracker):
    """Record each host tensor handed to a collective or point-to-point transfer while inside."""
    from ..distributed import shm_comm
    from ..pipeline import shm_p2p

    def wrap(name, fn):
        def call(*args, **kwargs):
            for t in _tensors(args) + _tensors(kwargs):
                if tracker.is_host(t):
                    tracker.host_in_collective.append(f"{caller()} {name} of a host {tuple(t.shape)} {t.dtype}")
            return fn(*args, **kwargs)
        return call

    originals = {name: getattr(dist, name) for name in COLLECTIVES if hasattr(dist, name)}
    wrapped = {id(fn): wrap(f"torch.distributed.{name}", fn) for name, fn in originals.items()}
    patches = []  # (owner, attribute, original)
    for module in [m for name, m in list(sys.modules.items()) if name.startswith("megatron_zero") or m is dist]:
        for attr, value in list(vars(module).items()):
            if id(value) in wrapped:
                patches.append((module, attr, value))
                setattr(module, attr, wrapped[id(value)])
    for owner, attr in ((shm_comm, "all_reduce"), (shm_comm, "all_reduce_async"), (shm_comm, "all_gather"),
                        (shm_p2p.SharedMemoryP2P, "exchange")):
        value = vars(owner)[attr]
        patches.append((owner, attr, value))
        setattr(owner, attr, wrap(f"{owner.__name__}.{attr}", value))
    try:
        yield tracker
    finally:
        for owner, attr, value in reversed(patches):
            setattr(owner, attr, value)
