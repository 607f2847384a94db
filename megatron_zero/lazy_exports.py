"""A package's public names imported from their submodules on first use (PEP 562's module `__getattr__`), so
that importing the package for one light submodule (the flags' checks, before torch is loaded) does not load
the heavy ones.

    __getattr__ = lazy_exports(__name__, {"MoELayer": ".layer", ...})
"""
from __future__ import annotations

import importlib
import importlib.util
import sys
from typing import Callable, Dict


def lazy_exports(package: str, exports: Dict[str, str]) -> Callable[[str], object]:
    """The module `__getattr__` of `package` that imports each of `exports` (name -> relative submodule), and
    a submodule by its name (`package.layers`), as the eager imports these replace made it an attribute."""
    def __getattr__(name: str):
        if name not in exports:
            if name.startswith("__") or importlib.util.find_spec(f"{package}.{name}") is None:
                raise AttributeError(f"module {package!r} has no attribute {name!r}")
            return importlib.import_module(f"{package}.{name}")
        value = getattr(importlib.import_module(exports[name], package), name)
        setattr(sys.modules[package], name, value)
        return value
    return __getattr__
