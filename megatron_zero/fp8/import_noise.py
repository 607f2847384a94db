"""What importing torchao prints that is not ours to fix, dropped once, here.

torchao's `import` tries to load its CUDA extensions (`_C_mxfp8`, `_C_cutlass_90a`) and logs a warning for each it
cannot load (every CPU machine, and a GPU build for another torch), and registers Enum classes with torch's pytree,
which torch 2.11+ logs as deprecated. None of it bears on float8 training, which needs neither; each rank printed
three such lines before any message of ours. A filter on those two loggers drops exactly those records; every other
warning of torchao or torch passes.
"""
from __future__ import annotations

import logging

_DROPPED = {"torchao": ("Failed to load ", ), "torch.utils._pytree": ("is an Enum subclass and is now natively",)}


def _drop(prefixes):
    def keep(record: logging.LogRecord) -> bool:
        text = record.getMessage()
        return not any(p in text for p in prefixes)
    return keep


def drop_torchao_import_noise() -> None:
    """Install the filters (idempotent)."""
    for name, prefixes in _DROPPED.items():
        logger = logging.getLogger(name)
        if not any(getattr(f, "_megatron_zero", False) for f in logger.filters):
            keep = _drop(prefixes)
            keep._megatron_zero = True
            logger.addFilter(keep)
