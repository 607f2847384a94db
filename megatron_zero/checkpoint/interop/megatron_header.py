"""The model-states header (args, iteration, scheduler) of a Megatron-LM checkpoint directory, as ours reads one,
for the model check before loading (compat.py) and the client state after it."""
from __future__ import annotations

from typing import Optional

from .megatron_layout import LEGACY, TORCH_DIST, checkpoint_format


def megatron_checkpoint_head(directory: str) -> Optional[dict]:
    """The header of a Megatron-LM torch_dist or legacy checkpoint directory; None for any other directory."""
    kind = checkpoint_format(directory)
    if kind == TORCH_DIST:
        from .torch_dist import megatron_head, read_common
        return megatron_head(read_common(directory))
    if kind == LEGACY:
        from .megatron_legacy import legacy_head
        return legacy_head(directory)
    return None
