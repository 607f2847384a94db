"""Checkpoints are data, never code: torch.load with weights_only=True and an allow-list of exactly the
non-tensor types our and DeepSpeed's checkpoints hold.

    obj = safe_load(path_or_file, mmap=True)      # raises RefusedGlobal naming the global it refused

What the allow-list holds, and why (nothing in it runs code on load: each is a plain container,
a value type, or a stand-in class with no behaviour):

| global in the pickle                                   | written by                           | loads as       |
|--------------------------------------------------------|--------------------------------------|----------------|
| argparse.Namespace                                     | Megatron(-DeepSpeed) `args`, ours    | itself         |
| types.SimpleNamespace                                  | our fragment_address                 | itself         |
| numpy.(_)core.multiarray._reconstruct, ndarray, dtype  | `np_rng_state` (numpy 1 and 2 names) | numpy arrays   |
| numeric dtype classes (numpy 2's numpy.dtypes.*)       | the same                             | numpy dtypes   |
| deepspeed.utils.tensor_fragment.fragment_address       | DeepSpeed's ZeRO-1/2 optimizer files | a stand-in     |
| deepspeed.runtime.fp16.loss_scaler.(Dynamic)LossScaler | DeepSpeed's optimizer files          | a stand-in     |
| deepspeed.runtime.zero.config.ZeroStageEnum            | DeepSpeed's optimizer files          | int            |

The DeepSpeed and Megatron names map to stand-ins defined here, so DeepSpeed's checkpoints load whether or not
deepspeed is installed, and none of DeepSpeed's code runs. Anything else (os.system, builtins.eval,
a class of some package) is refused before it is looked up.

Torch 2.6 and later take the allow-list as (object, "module.name") pairs in
torch.serialization.safe_globals(); torch 2.4 and 2.5 look a global up only by its object's own
`__module__` and name, so there each pair becomes a renamed stand-in (`_named`: a subclass or a
wrapper function carrying the name in the file), added for the one load and removed again, together
with `_codecs.encode`, which protocol 2 pickles bytes with (the numpy rng state's array) and which torch
allows by default only from 2.5.

This module imports only the standard library, torch and (lazily) numpy: the zero_to_fp32.py script
copied into every checkpoint imports it from next to itself.
"""
from __future__ import annotations

import _codecs
import argparse
import contextlib
import enum
import functools
import pickle
import re
import threading
import types

import torch


class RefusedGlobal(pickle.UnpicklingError):
    """The file refers to a global that is not on the allow-list (its name is `self.name`)."""

    def __init__(self, name: str, where: str):
        self.name = name
        super().__init__(f"{where} refers to the global {name}, which is not a type checkpoints hold; refused "
                         "without loading it (checkpoints are data, never code)")


class _Attributes:
    """A stand-in for a DeepSpeed class whose instances are plain attribute bags (no behaviour)."""

    def __init__(self, *args, **kwargs):
        self.__dict__.update(kwargs)

    def __repr__(self):
        return f"{type(self).__name__}({self.__dict__})"


class fragment_address(_Attributes):  # noqa: N801 (DeepSpeed's name)
    """DeepSpeed's dataclass fragment_address(numel, start)."""


class LossScaler(_Attributes):
    """DeepSpeed's static loss scaler object (cur_scale, ...)."""


class DynamicLossScaler(_Attributes):
    """DeepSpeed's dynamic loss scaler object (cur_scale, cur_iter, scale_window, ...)."""


class ModelType(enum.Enum):
    """Megatron's megatron.core.enums.ModelType, member for member (a value: an enum is data)."""
    encoder_or_decoder = 1
    encoder_and_decoder = 2
    retro_encoder = 3
    retro_decoder = 4


def _model_type(value) -> ModelType:
    """Megatron's ModelType(value) as the stand-in's member (a function: an enum cannot be subclassed,
    which torch 2.4/2.5's renamed allow-list entries need)."""
    return ModelType(value)


def _zero_stage(value) -> int:
    """DeepSpeed's ZeroStageEnum(value) as the int it is."""
    return int(value)


# stand-in -> the class it stands for: what torch_zip_writer writes in its place, so DeepSpeed and
# Megatron-DeepSpeed load their own classes from a file we write for them
PICKLED_AS = {
    fragment_address: "deepspeed.utils.tensor_fragment.fragment_address",
    LossScaler: "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    DynamicLossScaler: "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    ModelType: "megatron.core.enums.ModelType",
}


def _allowed() -> list:
    import numpy as np
    reconstruct = np._core.multiarray._reconstruct if hasattr(np, "_core") else np.core.multiarray._reconstruct
    return [
        argparse.Namespace, types.SimpleNamespace,
        (reconstruct, "numpy.core.multiarray._reconstruct"), (reconstruct, "numpy._core.multiarray._reconstruct"),
        (np.ndarray, "numpy.ndarray"), (np.dtype, "numpy.dtype"),
    ] + [  # the classes of numeric dtype instances (numpy 2), which the dtype's state is set on
        (type(np.dtype(c)), f"numpy.dtypes.{type(np.dtype(c)).__name__}") for c in "?bBhHiIlLqQefdFD"
    ] + [
        (fragment_address, "deepspeed.utils.tensor_fragment.fragment_address"),
        (LossScaler, "deepspeed.runtime.fp16.loss_scaler.LossScaler"),
        (DynamicLossScaler, "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler"),
        (_zero_stage, "deepspeed.runtime.zero.config.ZeroStageEnum"),
        (_model_type, "megatron.core.enums.ModelType"),
    ]


def _named(obj, path: str):
    """`obj` as torch 2.4/2.5's allow-list finds it under `path`: itself when its own name is `path`,
    else a subclass (for a class) or a wrapper (for a function) whose module and name are `path`'s."""
    module, name = path.rsplit(".", 1)
    if (obj.__module__, obj.__qualname__) == (module, name):
        return obj
    if isinstance(obj, type):
        return type(name, (obj,), {"__module__": module, "__qualname__": name})

    @functools.wraps(obj)
    def renamed(*args):
        return obj(*args)
    renamed.__module__, renamed.__name__, renamed.__qualname__ = module, name, name
    return renamed


def _torch_takes_named_pairs() -> bool:
    """torch.serialization.safe_globals() with (object, "module.name") pairs: torch 2.6 and later."""
    major, minor = (int(p) for p in torch.__version__.split(".")[:2])
    return (major, minor) >= (2, 6)


@contextlib.contextmanager
def _renamed_safe_globals(entries: list):
    """torch 2.4/2.5: add the entries as renamed stand-ins for one load, then restore the list."""
    before = list(torch.serialization.get_safe_globals())  # torch 2.4 returns the live list
    named = [_named(*e) if isinstance(e, tuple) else e for e in entries]
    torch.serialization.add_safe_globals(named + [_codecs.encode])
    try:
        yield
    finally:
        torch.serialization.clear_safe_globals()
        torch.serialization.add_safe_globals(before)


def _safe_globals(entries: list):
    if _torch_takes_named_pairs():
        return torch.serialization.safe_globals(entries)
    return _renamed_safe_globals(entries)


_LOCK = threading.Lock()  # safe_globals() swaps a process-wide set: one load at a time inside it
_GLOBAL = re.compile(r"GLOBAL (\S+)|unrecognized function (\S+)|but got (<[^>]+>)")


def safe_load(f, mmap: bool = False, where: str = "the checkpoint file", map_location=None):
    """torch.load(f) onto `map_location` (default the CPU), weights only plus the allow-list; a refused
    global raises RefusedGlobal."""
    try:
        with _LOCK, _safe_globals(_allowed()):
            return torch.load(f, map_location=map_location or torch.device("cpu"), mmap=mmap, weights_only=True)
    except pickle.UnpicklingError as e:
        m = _GLOBAL.search(str(e))
        if m is None:
            raise
        raise RefusedGlobal(next(g for g in m.groups() if g), where) from None
