"""Megatron-Core 0.16.1's Muon (`TensorParallelMuon` over emerging-optimizers 0.3.0) as the tests' reference,
importable on this Python: emerging-optimizers 0.3.0 declares Python >= 3.12 (it imports `typing.override`, which
typing_extensions provides on 3.11) and imports its Triton kernels at import (used only by `use_syrk`, which Muon
leaves off; a module saying Triton is absent stands in where triton is not installed). Megatron-Core 0.16.1 was
written against an earlier emerging-optimizers, whose keywords 0.3.0 renamed (OrthogonalizedOptimizer's
`use_nesterov` -> `nesterov`, newton_schulz_tp's `mode` -> `tp_mode`); `tensor_parallel_muon()` passes them under
their new names, nothing else changed."""
from __future__ import annotations

import sys
import types
import typing


def _shim() -> None:
    if not hasattr(typing, "override"):
        import typing_extensions
        typing.override = typing_extensions.override
    if "emerging_optimizers.triton_kernels" not in sys.modules:
        try:
            import triton  # noqa: F401
        except ImportError:
            kernels = types.ModuleType("emerging_optimizers.triton_kernels")
            kernels.HAS_TRITON_340 = False
            sys.modules["emerging_optimizers.triton_kernels"] = kernels


def tensor_parallel_muon():
    """Megatron-Core's TensorParallelMuon class."""
    _shim()
    from megatron.core.optimizer import muon
    if not muon.HAVE_EMERGING_OPTIMIZERS:
        raise ImportError("emerging-optimizers is not importable")
    base = muon.OrthogonalizedOptimizer
    if not getattr(base, "_renamed_keywords", False):
        init = base.__init__

        def renamed_init(self, *args, use_nesterov=None, **kwargs):
            if use_nesterov is not None:
                kwargs.setdefault("nesterov", use_nesterov)
            init(self, *args, **kwargs)
        base.__init__, base._renamed_keywords = renamed_init, True
        tp = muon.newton_schulz_tp
        muon.newton_schulz_tp = lambda *a, mode="duplicated", **k: tp(*a, tp_mode=mode, **k)
    return muon.TensorParallelMuon


def emerging_muon_utils():
    """emerging-optimizers' muon_utils (newton_schulz, newton_schulz_tp), without importing Megatron-Core."""
    _shim()
    from emerging_optimizers.orthogonalized_optimizers import muon_utils
    return muon_utils
