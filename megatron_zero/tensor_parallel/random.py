"""A TP-aware RNG tracker: dropout inside TP regions differs per TP rank, elsewhere it is identical.

Megatron's scheme, on the CPU generator (and the CUDA one where there is a GPU):

* the default generator is seeded `seed + 100 * pp_rank` on every rank, so TP ranks
  draw identical masks on replicated activations (hidden dropout, embeddings);
* the tracker's 'model-parallel-rng' state is seeded `seed + 100 * pp_rank + 2718 + tp_rank`;
  code that works on TP-sharded activations (attention-probability dropout) runs
  inside `get_rng_tracker().fork()`, which swaps that state in and out.

`get_states()` / `set_states()` save and restore every tracked state (checkpointing).
`checkpoint(fn, *args)` recomputes fn in backward under the tracker's states of the forward (activation
recomputation); `is_recomputing()` says whether such a recompute runs now.
"""
from __future__ import annotations

import contextlib
import random
from typing import Callable

import torch
import torch.utils.checkpoint

MODEL_PARALLEL_RNG = "model-parallel-rng"


def _device_state():
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_device_state(state):
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _seeded_state(seed):
    """The generator state(s) a fresh manual_seed(seed) would give, without disturbing the current ones."""
    saved = _device_state()
    torch.manual_seed(seed)  # seeds CPU and, where present, every CUDA device
    state = _device_state()
    _set_device_state(saved)
    return state


class RNGStatesTracker:
    """Named generator states; `fork(name)` runs a block on one of them."""

    def __init__(self):
        self.states = {}
        self.seeds = set()

    def reset(self):
        self.states, self.seeds = {}, set()

    def add(self, name: str, seed: int):
        if seed in self.seeds:
            raise ValueError(f"the RNG seed {seed} is already tracked; give {name!r} another seed")
        if name in self.states:
            raise ValueError(f"the RNG state {name!r} is already tracked")
        self.seeds.add(seed)
        self.states[name] = _seeded_state(seed)

    def get_states(self):
        return {name: {k: v.clone() for k, v in state.items()} for name, state in self.states.items()}

    def set_states(self, states):
        self.states = {name: {k: v.clone() for k, v in state.items()} for name, state in states.items()}

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG):
        if name not in self.states:
            raise RuntimeError(f"the RNG state {name!r} is not tracked; call "
                               "megatron_zero.tensor_parallel.random.model_parallel_seed(seed, tp_rank, pp_rank) first")
        outside = _device_state()
        _set_device_state(self.states[name])
        try:
            yield
        finally:
            self.states[name] = _device_state()
            _set_device_state(outside)


_TRACKER = RNGStatesTracker()


def get_rng_tracker() -> RNGStatesTracker:
    return _TRACKER


CP_SEED_STRIDE = 7919  # a prime above 100 x any pipeline size: CP streams never meet another stage's


def model_parallel_seed(seed: int, tp_rank: int = 0, pp_rank: int = 0, cp_rank: int = 0) -> None:
    """Seed python, torch's default generator and the tracker the way Megatron does; context-parallel ranks
    hold different tokens, so each CP rank draws its dropout masks from its own streams (offset by
    CP_SEED_STRIDE x cp_rank; CP rank 0 draws what a run without CP draws)."""
    base = seed + 100 * pp_rank + CP_SEED_STRIDE * cp_rank
    random.seed(base)
    try:
        import numpy as np
        np.random.seed(base)
    except ImportError:
        pass
    torch.manual_seed(base)
    _TRACKER.reset()
    _TRACKER.add(MODEL_PARALLEL_RNG, base + 2718 + tp_rank)


_RECOMPUTING = {"depth": 0}


def is_recomputing() -> bool:
    """Whether the layers running now are a checkpointed segment's recompute in backward."""
    return _RECOMPUTING["depth"] > 0


def checkpoint(fn: Callable, *args):
    """fn(*args) without keeping its activations; backward recomputes them under the same RNG states."""
    if not torch.is_grad_enabled():
        return fn(*args)
    tracker = get_rng_tracker()
    at_forward = tracker.get_states()
    calls = 0

    def run(*inputs):
        nonlocal calls
        calls += 1
        if calls == 1:
            return fn(*inputs)
        outside = tracker.get_states()  # the recompute happens in backward: put back what it finds
        tracker.set_states(at_forward)
        _RECOMPUTING["depth"] += 1
        try:
            return fn(*inputs)
        finally:
            _RECOMPUTING["depth"] -= 1
            tracker.set_states(outside)

    return torch.utils.checkpoint.checkpoint(run, *args, use_reentrant=False, preserve_rng_state=True)
