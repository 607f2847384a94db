"""The costliest autograd Functions of a traced micro-batch measured once per input shape and replayed.

The fused loss's vocabulary chunks (tensor_parallel/output_loss.py) and the CP ring's steps
(context_parallel/ring_attention.py) are most of a probe trace's operators, and a search runs each of them
with the same inputs again and again: in every block, in every recomputation, in the probe of every stage
role and recomputation mode of the same TP x CP x micro-batch. What a trace reads of such a Function is
only how it moves the live bytes (planning/live_bytes.py): its forward's peak above the bytes alive when it
starts, the new storages it leaves (its outputs and what it saves for backward), its backward's peak and
the gradients it returns. Those are measured the first time the Function runs with a given key (its
tensors' shapes, strides, dtypes and requires-grad; a process group by its size and this rank's place in
it, a list of ranks by its length, since they only address the messages; anything else by value), and
replayed whenever it runs again with that key:

    forward   a uint8 tensor of the forward's peak bytes, freed at once; the outputs (empty, with the
              measured shapes and strides); saved for backward, slot by slot, what the real forward saves
              (the same input or output, or an empty tensor of the same bytes for a storage of its own)
    backward  the saved tensors unpacked (under full recomputation that is what runs the recompute, at the
              same point), a uint8 tensor of the backward's peak bytes, freed; the gradients (empty)

so the bytes alive at every operator outside the Function, and the peak, are those of the real run. A key
is replayed only once both its forward and backward are measured (a replayed forward has no state for a
real backward). A Function whose storages the replay could not reproduce (an output or gradient that is a
view of a larger or an older storage, a saved tensor of a storage older than the call that no input
holds, a new storage alive after the call that is neither an output nor saved) runs for real every time.
tests/test_plan.py holds probes that replay equal, to the byte, to the whole-stage traces that do not.
"""
from __future__ import annotations

import contextlib
from collections import Counter
from dataclasses import dataclass
from typing import Dict, Iterator, Optional, Tuple

import torch
import torch.distributed as dist

from .live_bytes import LiveBytes


def replayed_functions() -> tuple:
    from ..context_parallel.ring_attention import RingAttention
    from ..tensor_parallel.output_loss import _LinearCrossEntropy
    return (_LinearCrossEntropy, RingAttention)


@dataclass(frozen=True)
class _Tensor:
    """A tensor a Function returns: which of its new storages it lies in, and where."""

    storage: int
    shape: tuple
    stride: tuple
    offset: int
    dtype: torch.dtype


def _make(storages: Tuple[int, ...], tensors) -> list:
    """New tensors as measured, over new storages of the measured bytes (equal descriptions: one tensor): a
    tensor alone in its storage made as itself, the others as views of a uint8 tensor of their storage's
    bytes."""
    users = Counter(t.storage for t in set(tensors) if t is not None)
    blobs, made = {}, {}
    for t in tensors:
        if t is None or t in made:
            continue
        if users[t.storage] == 1 and not t.offset and _span(t.shape, t.stride, t.dtype) == storages[t.storage]:
            made[t] = torch.empty_strided(t.shape, t.stride, dtype=t.dtype)
        else:
            if t.storage not in blobs:
                blobs[t.storage] = torch.empty(storages[t.storage], dtype=torch.uint8)
            made[t] = blobs[t.storage].view(t.dtype).as_strided(t.shape, t.stride, t.offset)
    return [None if t is None else made[t] for t in tensors]


def _span(shape, stride, dtype) -> int:
    if not all(shape):
        return 0
    return (1 + sum((n - 1) * st for n, st in zip(shape, stride))) * dtype.itemsize


@dataclass(frozen=True)
class _Forward:
    peak: int
    storages: Tuple[int, ...]          # bytes of each new storage it leaves (outputs, saved)
    outputs: Tuple[Optional[_Tensor], ...]
    single: bool                       # one tensor returned, not a tuple
    saved: tuple                       # per slot: ("input", i), ("own", _Tensor) or ("none", None)


@dataclass(frozen=True)
class _Backward:
    peak: int
    storages: Tuple[int, ...]
    grads: Tuple[Optional[_Tensor], ...]


def _key(fn, args) -> tuple:
    parts = [fn]
    for a in args:
        if isinstance(a, torch.Tensor):
            parts.append((tuple(a.shape), a.stride(), a.storage_offset(), a.dtype, a.device.type, a.requires_grad))
        elif isinstance(a, dist.ProcessGroup):
            parts.append(("group", dist.get_world_size(a), dist.get_rank(a)))
        elif type(a) is list and all(isinstance(r, int) for r in a):
            parts.append(("ranks", len(a)))
        else:
            parts.append(repr(a))
    return tuple(parts)


def _new_storages(segment: LiveBytes) -> dict:
    return {id(s): s.nbytes() for s in segment.alive()}


def _describe(t, new: dict, index: dict) -> Optional[_Tensor]:
    """t as a _Tensor of a new storage (numbered in `index` as first met), None for a non-tensor; raises
    _Unreplayable where t lies in an older storage."""
    if not isinstance(t, torch.Tensor):
        return None
    sid = id(t.untyped_storage())
    if sid not in new:
        raise _Unreplayable
    return _Tensor(index.setdefault(sid, len(index)), tuple(t.shape), t.stride(), t.storage_offset(), t.dtype)


class _Unreplayable(Exception):
    pass


class _Ctx:
    """A Function's ctx as its forward or backward sees it, noting what the forward saves; the backward's
    saved tensors already unpacked (outside the measured part)."""

    def __init__(self, ctx, saved=None):
        object.__setattr__(self, "_ctx", ctx)
        object.__setattr__(self, "_unpacked", saved)
        object.__setattr__(self, "saved", ())

    def save_for_backward(self, *tensors):
        object.__setattr__(self, "saved", tensors)
        self._ctx.save_for_backward(*tensors)

    @property
    def saved_tensors(self):
        return self._unpacked

    def __getattr__(self, name):
        return getattr(self._ctx, name)

    def __setattr__(self, name, value):
        setattr(self._ctx, name, value)


def _measure_forward(segment: LiveBytes, args, out, saved) -> Optional[_Forward]:
    new, index = _new_storages(segment), {}
    outputs, single = ((out,), True) if not isinstance(out, tuple) else (out, False)
    inputs = {id(a.untyped_storage()): i for i, a in enumerate(args) if isinstance(a, torch.Tensor)}
    try:
        specs = tuple(_describe(t, new, index) for t in outputs)
        slots = []
        for t in saved:
            sid = None if t is None else id(t.untyped_storage())
            if t is None:
                slots.append(("none", None))
            elif sid in new:
                slots.append(("own", _describe(t, new, index)))
            elif sid in inputs and t is args[inputs[sid]]:
                slots.append(("input", inputs[sid]))
            else:
                raise _Unreplayable
    except _Unreplayable:
        return None
    if set(new) != set(index):
        return None  # something else it made outlives the call
    return _Forward(segment.peak, tuple(new[s] for s in index), specs, single, tuple(slots))


def _measure_backward(segment: LiveBytes, grads) -> Optional[_Backward]:
    new, index = _new_storages(segment), {}
    try:
        specs = tuple(_describe(g, new, index) for g in grads)
    except _Unreplayable:
        return None
    if set(new) != set(index):
        return None
    return _Backward(segment.peak, tuple(new[s] for s in index), specs)


class Replays:
    """The measured Functions of a search (shared by its probes' traces), by key."""

    def __init__(self):
        self._forward: Dict[tuple, _Forward] = {}
        self._backward: Dict[tuple, _Backward] = {}
        self._real: set = set()  # keys the replay cannot reproduce
        self.replayed = 0        # calls replayed (forward and backward)

    def measured(self) -> set:
        """The Functions with a key measured both ways (that replay)."""
        return {key[0] for key in self._forward if key in self._backward}

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        """Within the block, replayed_functions() run through this cache."""
        originals = {}
        for fn in replayed_functions():
            originals[fn] = fn.__dict__.get("apply")
            fn.apply = staticmethod(lambda *args, fn=fn: _Replayed.apply(*args, fn, _key(fn, args), self))
        try:
            yield
        finally:
            for fn, original in originals.items():
                if original is None:
                    del fn.apply
                else:
                    fn.apply = original

    def forward(self, ctx, fn, key, args):
        measured = self._forward.get(key)
        if measured is not None and key in self._backward:
            self.replayed += 1
            return self._replay_forward(ctx, measured, args)
        inner = _Ctx(ctx)
        with LiveBytes() as segment:
            out = fn.forward(inner, *args)
        if measured is None and key not in self._real:
            measured = _measure_forward(segment, args, out, inner.saved)
            if measured is None:
                self._real.add(key)
            else:
                self._forward[key] = measured
        return out

    def backward(self, ctx, fn, key, grads):
        saved = ctx.saved_tensors  # (unpacked first, as the Function's own backward does)
        measured = self._backward.get(key)
        if measured is not None:
            self.replayed += 1
            torch.empty(measured.peak, dtype=torch.uint8)  # the backward's peak, freed at once
            return tuple(_make(measured.storages, measured.grads))
        with LiveBytes() as segment:
            out = fn.backward(_Ctx(ctx, saved), *grads)
        out = out if isinstance(out, tuple) else (out,)
        if key not in self._real:
            measured = _measure_backward(segment, out)
            if measured is None:
                self._real.add(key)
            else:
                self._backward[key] = measured
        return out

    @staticmethod
    def _replay_forward(ctx, measured: _Forward, args):
        torch.empty(measured.peak, dtype=torch.uint8)  # the forward's peak, freed at once
        own = [t for kind, t in measured.saved if kind == "own"]
        made = _make(measured.storages, [*measured.outputs, *own])
        outputs, own = made[:len(measured.outputs)], iter(made[len(measured.outputs):])
        ctx.save_for_backward(*(args[i] if kind == "input" else next(own) if kind == "own" else None
                                for kind, i in measured.saved))
        return outputs[0] if measured.single else tuple(outputs)


class _Replayed(torch.autograd.Function):
    """A replayed Function's node: its own inputs, then the Function, its key and the Replays."""

    @staticmethod
    def forward(ctx, *inputs):
        *args, fn, key, replays = inputs
        ctx.replayed_as = (fn, key, replays)
        return replays.forward(ctx, fn, key, args)

    @staticmethod
    def backward(ctx, *grads):
        fn, key, replays = ctx.replayed_as
        return (*replays.backward(ctx, fn, key, grads), None, None, None)
