"""Conjugate communication pairs as autograd functions, written once.

Most collectives of the model parallelisms come in pairs whose backward is the other's forward
(identity / all-reduce, split / all-gather, reduce-scatter / all-gather, all-to-all one way / back):

    Forward, Backward = conjugate_pair(f, g)
    Forward.apply(x, *args) == f(x, *args),  its gradient g(grad, *args)
    Backward.apply(x, *args) == g(x, *args), its gradient f(grad, *args)

`args` are the non-tensor arguments both directions need (the group, sizes, ...).
"""
from __future__ import annotations

from typing import Callable, Tuple, Type

import torch

from ..ops.eager import eager


def _function(name: str, forward: Callable, backward: Callable) -> Type[torch.autograd.Function]:
    def fwd(ctx, x, *args):
        ctx.args = args
        return forward(x, *args)

    def bwd(ctx, grad):
        return (backward(grad, *ctx.args),) + (None,) * len(ctx.args)

    cls = type(name, (torch.autograd.Function,), {"forward": staticmethod(fwd), "backward": staticmethod(bwd)})
    cls.apply = eager(cls.apply)  # a collective: eager inside a compiled layer (ops/eager.py)
    return cls


def conjugate_pair(f: Callable, g: Callable) -> Tuple[Type[torch.autograd.Function], Type[torch.autograd.Function]]:
    """(F, G): F computes f with gradient g, G computes g with gradient f."""
    return (_function(f"{f.__name__.strip('_')}_then_{g.__name__.strip('_')}", f, g),
            _function(f"{g.__name__.strip('_')}_then_{f.__name__.strip('_')}", g, f))
