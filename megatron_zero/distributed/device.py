"""Where a rank's tensors live: the one device chosen at start-up, and the host memory that feeds it.

    device = select_device("auto", local_rank)   # cuda:LOCAL_RANK where CUDA is present, else the CPU
    backend = backend_for(device)                # nccl with CUDA, gloo with the CPU

The device is chosen once (training.pretrain) and passed down as a `torch.device`;
everything a step touches is created on it. This module is the only place that asks
what kind of device it is: host staging buffers are pinned (page-locked) when the
device is a GPU, so host<->device copies can be `non_blocking`; on the CPU the same
calls are plain allocations and copies, and `synchronize` does nothing. Copies that should
overlap compute run on a side stream (`copy_stream`, `on_stream`, `record_event`, `wait_event`,
`join_stream`):
a `torch.cuda.Stream` on a GPU; on the CPU the stream is None, its context does nothing and the
copies are done when issued.
"""
from __future__ import annotations

from contextlib import contextmanager
from functools import lru_cache
from typing import Any, Dict, Optional

import torch

from .device_error import DeviceError

HOST = torch.device("cpu")
DEVICE_CHOICES = ("auto", "cuda", "cpu")


def select_device(choice: str = "auto", local_rank: int = 0) -> torch.device:
    """'auto': cuda:LOCAL_RANK where CUDA is present, else the CPU; 'cuda' / 'cpu' force it."""
    if choice not in DEVICE_CHOICES:
        raise DeviceError(f"--device {choice!r} is not one of {', '.join(DEVICE_CHOICES)}")
    if choice == "cpu" or (choice == "auto" and not torch.cuda.is_available()):
        return HOST
    if not torch.cuda.is_available():
        raise DeviceError("--device cuda was given but torch sees no CUDA device "
                          f"(torch {torch.__version__}); use --device cpu")
    return torch.device("cuda", local_rank % torch.cuda.device_count())


def backend_for(device: torch.device, requested: Optional[str] = None) -> str:
    """The process-group backend for `device`: nccl with CUDA, gloo with the CPU; `requested`
    (--distributed-backend) when it can move the device's tensors, else a DeviceError."""
    if requested == "gloo" and device.type == "cuda":
        raise DeviceError(f"--distributed-backend gloo cannot run the collectives of a rank training on {device} "
                          "(the ZeRO and tensor-parallel collectives need NCCL for CUDA tensors); leave "
                          "--distributed-backend out to get nccl, or train with --device cpu")
    return requested or ("nccl" if device.type == "cuda" else "gloo")


def use_device(device: torch.device) -> None:
    """Make `device` the current CUDA device of this process (NCCL and the CUDA RNG follow it)."""
    if device.type == "cuda":
        torch.cuda.set_device(device)


def host_empty(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host buffer to stage copies to/from `device`: pinned when the device is a GPU."""
    return torch.empty(numel, dtype=dtype, device=HOST, pin_memory=device.type == "cuda")


def ints_to_device(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A short list of host integers as a tensor on `device`, copied from pinned memory without blocking
    (a plain copy from pageable memory would wait for the device's queued work)."""
    t = torch.tensor(values, dtype=dtype)
    if device.type == HOST.type:
        return t
    return t.pin_memory().to(device, non_blocking=True)


def to_device(batch: Dict[str, Any], device: torch.device) -> Dict[str, Any]:
    """A collated batch (host tensors) on `device`: pinned first, then copied without blocking."""
    if device.type == HOST.type:
        return batch
    return {k: v.pin_memory().to(device, non_blocking=True) if torch.is_tensor(v) else v
            for k, v in batch.items()}


def synchronize(device: torch.device) -> None:
    """Wait for the copies queued on `device` (host buffers written by non_blocking copies)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_stream(device: torch.device) -> Optional["torch.cuda.Stream"]:
    """A side stream for host<->device copies on `device` (None on the CPU: copies are synchronous)."""
    return torch.cuda.Stream(device) if device.type == "cuda" else None


@contextmanager
def on_stream(stream, device: torch.device):
    """Queue work on `stream` after what `device`'s current stream has queued so far (nothing on the CPU)."""
    if stream is None:
        yield
        return
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        yield


def record_event(stream):
    """An event marking the work queued on `stream` so far (None on the CPU: it is done already)."""
    if stream is None:
        return None
    event = torch.cuda.Event()
    event.record(stream)
    return event


def wait_event(event) -> None:
    """Block the host until `event`'s work is done."""
    if event is not None:
        event.synchronize()


def join_stream(stream, device: torch.device) -> None:
    """Make `device`'s current stream wait for the work queued on `stream` so far, without blocking
    the host (nothing on the CPU)."""
    if stream is not None:
        torch.cuda.current_stream(device).wait_stream(stream)


@lru_cache(maxsize=None)
def has_grouped_mm(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether torch.nn.functional.grouped_mm runs forward and backward on `device` in `dtype`: CUDA,
    bf16, compute capability 8.0 or later (torch's rule); elsewhere callers loop over the groups."""
    return (device.type == "cuda" and dtype == torch.bfloat16 and hasattr(torch.nn.functional, "grouped_mm")
            and torch.cuda.get_device_capability(device) >= (8, 0))
