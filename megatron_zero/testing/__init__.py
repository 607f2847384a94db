"""Test support, not part of training: helpers the tests and benchmarks share (running a function on N gloo ranks
on the CPU, tiny models, flag fixtures, peer references); the trainer and tools/ never import it."""
from .multirank import RankFailure, run_ranks

__all__ = ["RankFailure", "run_ranks"]
