"""CopyCounter: the bytes that copying aten ops write on the calling thread while it is active.

    with CopyCounter() as copies:
        y = gather_from_sequence_parallel_region(x, group); y.sum().backward()
    copies.bytes, copies.calls   # {"aten.cat": bytes, ...}, {"aten.cat": calls, ...}

Counted: cat, stack, clone (`.contiguous()` of a strided tensor is one), `_to_copy`, `copy_`, each by the
bytes of what it writes. What a collective moves inside its backend is transport, not a copy of the
activation, and is not counted: it runs on the backend's threads (NCCL's kernels, gloo's), or, where gloo
copies its result out on the caller's thread (its reduce-scatter is an all-reduce keeping one chunk), inside
a torch.distributed call, which is how it is told apart here.
"""
from __future__ import annotations

import os
import traceback
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
COPYING = {aten.cat.default, aten.stack.default, aten.clone.default, aten._to_copy.default, aten.copy_.default}


class CopyCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.bytes, self.calls = Counter(), Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in COPYING and not _inside_torch_distributed():
            written = args[0] if func is aten.copy_.default else out
            name = f"aten.{func.__name__.split('.')[0]}"
            self.bytes[name] += written.numel() * written.element_size()
            self.calls[name] += 1
        return out

    @property
    def total(self) -> int:
        return sum(self.bytes.values())


_DISTRIBUTED = os.path.dirname(torch.distributed.__file__)


def _inside_torch_distributed() -> bool:
    return any(frame.filename.startswith(_DISTRIBUTED) for frame in traceback.extract_stack())
