"""Helpers for tests and benchmarks: running a function on N gloo ranks on the CPU."""
from .multirank import RankFailure, run_ranks

__all__ = ["RankFailure", "run_ranks"]
