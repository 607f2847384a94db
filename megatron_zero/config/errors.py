"""The configuration's one error type and its one check helper."""
from __future__ import annotations


class ArgumentError(ValueError):
    """A flag or combination of flags that cannot work (one sentence)."""


def require(cond: bool, sentence: str) -> None:
    """Refuse with `sentence` (naming the flags, their values and what would be right) unless `cond`."""
    if not cond:
        raise ArgumentError(sentence)
