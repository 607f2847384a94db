"""The attention core of a context-parallel rank: `--cp-comm-type` picks how K/V reach the queries (p2p: a ring;
all_gather: every rank gathers them; a2a: heads scattered, sequences gathered, Ulysses; a2a+p2p: a2a within
groups of consecutive CP ranks, then a ring across the groups).

The blocks of p2p and a2a+p2p run by torch's flash kernel (flash_blocks.py) or block_attention's query
pieces, as `--attention-backend` says: unfused (and fused) the pieces; flash and auto the flash kernel
where it serves the inputs (no attention dropout, its dtypes and head dims, the op in this torch), the
pieces elsewhere. Rank 0 says once which one runs, and why where it is not the flash kernel."""
from __future__ import annotations

from typing import Callable, Optional, Tuple

import torch
import torch.distributed as dist

from ..tensor_parallel import get_rng_tracker
from .all_gather_attention import all_gather_attention
from .block_attention import Dropout
from .comm_types import CP_COMM_TYPES
from .flash_blocks import CPU_OP, CUDA_OP, flash_unavailable
from .hierarchical_attention import hierarchical_attention
from .ring_attention import ring_attention
from .ulysses_attention import ulysses_attention


def ring_kernel(backend: str, dropout: Optional[Dropout], q: torch.Tensor) -> Tuple[bool, str]:
    """(whether the ring's blocks run by the flash kernel, the phrase saying which kernel and why)."""
    if backend in ("unfused", "fused"):
        return False, f"block_attention's query pieces (--attention-backend {backend})"
    why = "attention dropout" if dropout is not None else flash_unavailable(q)
    if why is not None:
        return False, f"block_attention's query pieces, not the flash kernel: {why}"
    return True, f"the flash kernel aten.{CPU_OP if q.device.type == 'cpu' else CUDA_OP} (no [q, k] scores)"


_said = set()


def _say_once(comm_type: str, phrase: str) -> None:
    if (comm_type, phrase) not in _said:
        _said.add((comm_type, phrase))
        if not dist.is_initialized() or dist.get_rank() == 0:
            print(f"context parallelism (--cp-comm-type {comm_type}): attention blocks by {phrase}", flush=True)


def context_parallel_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp_group, comm_type: str,
                               core: Optional[Callable] = None, dropout_p: float = 0.0, hierarchy=None,
                               backend: str = "auto"):
    """Causal attention of this CP rank's queries over the whole sequence: q [b, heads, s / cp, d], k and v
    [b, groups, s / cp, d] (the KV heads, not expanded) -> context [b, heads, s / cp, d]. `core(q, k, v)`:
    the whole-sequence attention a2a runs (model/attention_core.py's, with its backend and dropout); p2p
    and all_gather compute their blocks themselves, with attention dropout `dropout_p` (0 in eval): the
    masks hash a seed drawn from the RNG tracker's per-TP-rank stream (per CP rank too: model_parallel_seed),
    which recomputation replays (block_attention.keep_mask). a2a+p2p: `hierarchy` is (the all-to-all group,
    the ring group) of this rank (distributed/topology.py's cp_a2a and cp_p2p groups). `backend`: --attention-backend,
    which picks the p2p and a2a+p2p blocks' kernel (`ring_kernel`)."""
    if comm_type == "a2a":
        if core is None:
            raise ValueError("--cp-comm-type a2a needs the whole-sequence attention core")
        return ulysses_attention(q, k, v, cp_group, core)
    cp, cp_rank = dist.get_world_size(cp_group), dist.get_rank(cp_group)
    seq_length = q.shape[2] * cp
    dropout = None
    if dropout_p > 0:
        with get_rng_tracker().fork():
            dropout = Dropout(dropout_p, int(torch.randint(2**31 - 1, (1,))))  # the CPU generator: no device sync
    if comm_type in ("p2p", "a2a+p2p"):
        flash, phrase = ring_kernel(backend, dropout, q)
        _say_once(comm_type, phrase)
    if comm_type == "p2p":
        return ring_attention(q, k, v, seq_length, cp_group, dist.get_process_group_ranks(cp_group), cp_rank,
                              dropout, flash)
    if comm_type == "a2a+p2p":
        if hierarchy is None:
            raise ValueError("--cp-comm-type a2a+p2p needs the all-to-all and ring groups of the CP group")
        return hierarchical_attention(q, k, v, seq_length, *hierarchy, dropout, flash)
    if comm_type == "all_gather":
        return all_gather_attention(q, k, v, seq_length, cp_group, cp, cp_rank, dropout)
    raise ValueError(f"--cp-comm-type must be one of {', '.join(CP_COMM_TYPES)}, got {comm_type!r}")
