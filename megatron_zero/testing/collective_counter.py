"""CollectiveCounter: each torch.distributed collective this thread issues while it is active, with its bytes.

    with CollectiveCounter() as seen:
        opt.backward(loss); opt.step()
    seen.calls   # [(op name, (bytes of each tensor argument, in order)), ...] in issue order
    seen.calls[0] == ("c10d::_reduce_scatter_base_", (4000, 8000))    # (output, input)

The collectives are the `c10d` operators the process-group calls dispatch (allreduce_, _reduce_scatter_base_,
_allgather_base_, allgather_, broadcast_, ...), so every backend's are seen; shm_comm's shared-memory
collectives are not torch.distributed's (turn them off, shm_comm.set_shared_memory_comm(False), to count
everything). Bytes are per tensor argument (a list's summed), in the operator's order: output first for
_reduce_scatter_base_ and _allgather_base_ (c10d's schemas), the in-place list for allreduce_.
"""
from __future__ import annotations

from typing import List, Tuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode


def _nbytes(arg) -> int:
    if isinstance(arg, torch.Tensor):
        return arg.numel() * arg.element_size()
    if isinstance(arg, (list, tuple)):
        return sum(_nbytes(a) for a in arg)
    return 0


class CollectiveCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls: List[Tuple[str, Tuple[int, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "c10d":
            self.calls.append((func.name(), tuple(_nbytes(a) for a in args if _nbytes(a))))
        return func(*args, **(kwargs or {}))

    def named(self, *fragments: str) -> List[Tuple[str, Tuple[int, ...]]]:
        """The calls whose op name contains any of `fragments`."""
        return [c for c in self.calls if any(f in c[0] for f in fragments)]
