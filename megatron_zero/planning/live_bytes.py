"""Bytes of live tensor storage, and its peak, over a region of code: real tensors or fake ones.

    with LiveBytes() as live:        # counts every storage an operator creates while the region runs
        loss = model(tokens, labels); loss.backward()
    live.peak                        # the most bytes alive at once (storage created inside the region)

Works the same under torch's FakeTensorMode (no memory allocated: the planner's trace) and on real
tensors (the measurement the trace is checked against): each storage an operator returns is counted
once, and leaves the count when its last reference goes (a weak reference's callback), the way a
caching allocator sees a block freed. Storage that existed before the region (weights, optimizer
state) is not counted; an in-place or view output shares its input's storage and adds nothing. A tensor
subclass that wraps others (torchao's float8 tensors: their FP8 data and scale) is counted by the tensors
it wraps.
"""
from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves


class LiveBytes(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.current = 0
        self.peak = 0
        self._seen = {}  # id(storage) -> weak reference (its callback takes the bytes off again)

    def _count(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        key = id(storage)
        if key in self._seen and self._seen[key]() is storage:
            return
        nbytes = storage.nbytes()
        self.current += nbytes
        self.peak = max(self.peak, self.current)
        self._seen[key] = weakref.ref(storage, lambda _, k=key, n=nbytes: self._free(k, n))

    def _free(self, key: int, nbytes: int) -> None:
        self._seen.pop(key, None)
        self.current -= nbytes

    def alive(self) -> list:
        """The storages created in the region that are still alive."""
        return [s for s in (ref() for ref in self._seen.values()) if s is not None]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # only an operator whose schema says an output aliases an input (views, in-place, out=) can return an
        # input's storage; the others' outputs are new storage (the input scan is most of this mode's cost)
        inputs = {id(s.untyped_storage()) for t in tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor) for s in _plain(t)} if _may_alias(func) else ()
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                for s in _plain(t):
                    if id(s.untyped_storage()) not in inputs:
                        self._count(s)
        return out


def _plain(t: torch.Tensor):
    """The tensors holding `t`'s bytes: itself, or those a wrapper subclass wraps (its __tensor_flatten__)."""
    wraps = _WRAPS.get(type(t))
    if wraps is None:
        wraps = _WRAPS[type(t)] = is_traceable_wrapper_subclass(t)
    if not wraps:
        return (t,)
    return tuple(s for name in t.__tensor_flatten__()[0] for s in _plain(getattr(t, name)))


_WRAPS = {torch.Tensor: False}  # tensor type -> whether it wraps others


_ALIASING = {}  # operator -> whether an output of its schema may alias an input


def _may_alias(func) -> bool:
    may = _ALIASING.get(func)
    if may is None:
        schema = getattr(func, "_schema", None)
        may = _ALIASING[func] = schema is None or any(r.alias_info is not None for r in schema.returns)
    return may
