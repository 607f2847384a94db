"""The local experts' weights of one matmul as one [E, ...] tensor without copying them.

ZeRO 0-2 (zero/stage12.py) make every parameter a view of its param group's flat buffer, in the
group's order; ZeRO-3 (zero/stage3_storage.py) makes every parameter one gather brings a view of one
storage, in the unit's order, each starting on a 16-byte boundary. Either way the experts of a layer
follow one another with the same parameters each, so the experts' weights of one matmul lie in one
storage a fixed number of elements apart. `stacked` then returns that stride's view over the storage,
[E, *shape], through an autograd function whose backward hands expert e the slice grad[e]
(torch.stack's backward, so the gradients are the same bits): the checkpoint layout, the flat buffers
and their order stay as they are, and no forward copies a weight. Weights laid out otherwise (separate
tensors: a model without a ZeRO wrapper; experts split over two ZeRO-3 gathers) are stacked by a copy.
"""
from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch

ALIGN_BYTES = 16  # grouped_mm's rule: every operand, and every row of one, starts on a 16-byte boundary


def expert_stride(weights: Sequence[torch.Tensor], aligned: bool = True) -> Optional[int]:
    """Elements between consecutive weights when they are equally spaced, same-shaped, contiguous and
    non-overlapping in one storage (with ``aligned``, starting on 16-byte boundaries); None otherwise."""
    w0 = weights[0]
    if not w0.is_contiguous() or w0.numel() == 0:
        return None
    item, storage = w0.element_size(), w0.untyped_storage().data_ptr()
    step = weights[1].storage_offset() - w0.storage_offset() if len(weights) > 1 else w0.numel()
    if step < w0.numel() or (aligned and ((step * item) % ALIGN_BYTES or w0.data_ptr() % ALIGN_BYTES)):
        return None
    for e, w in enumerate(weights):
        if (w.shape != w0.shape or w.dtype != w0.dtype or w.device != w0.device or not w.is_contiguous()
                or w.untyped_storage().data_ptr() != storage
                or w.storage_offset() != w0.storage_offset() + e * step):
            return None
    return step


def _view(weights: Sequence[torch.Tensor], step: int) -> torch.Tensor:
    w0 = weights[0]
    return w0.as_strided((len(weights), *w0.shape), (step, *w0.stride()), w0.storage_offset())


class _StackedView(torch.autograd.Function):
    """Forward: the [E, ...] view over the weights' storage. Backward: grad[e] to weight e."""

    @staticmethod
    def forward(ctx, step: int, *weights: torch.Tensor) -> torch.Tensor:
        return _view(weights, step)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> Tuple:
        return (None, *grad.unbind(0))


def stacked(weights: Sequence[torch.Tensor], aligned: bool = True) -> torch.Tensor:
    """[E, *shape] of the experts' weights: a view where they lie equally spaced in one storage (aligned
    for grouped_mm with ``aligned``), else a copy."""
    step = expert_stride(weights, aligned)
    if step is None:
        return torch.stack(list(weights))
    return _StackedView.apply(step, *weights)
