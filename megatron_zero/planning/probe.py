"""A stage of n identical blocks planned from probes of the same stage with one and two blocks.

A fake build or trace costs per operator, so an 80-layer stage costs 80 blocks' worth whatever its tensors'
sizes. When the stage's blocks are all alike, the model code builds the same stage kind with one block (its
parameters) and builds and traces it with two (the config's num_layers set to 1 or 2 per stage, everything
else as the run has it; one block's saved bytes, saved(2) - saved(1), are the live bytes' growth over the
second block's forward in that one trace: its saved tensors, and its output in place of its input), and:

    parameters   the one-block probe's, its block's parameters repeated n times (renamed to the real layer
                 indices, in module order): the same list the n-block stage builds
    saved        saved(2) + (n - 2) x (saved(2) - saved(1))   one block's saved tensors per block
    peak         peak(2) + (n - 2) x (saved(2) - saved(1))    the peak, in the last block's backward or the
                                                              loss, sits above all earlier blocks' saved tensors

A probe depends on the stage's role (only, first, middle or last: what it holds besides blocks), not on the
pipeline size, so one probe serves every PP degree of a search; its activations not on EP either (traced at
EP 1, as trace_rank does). Blocks are alike unless some are MoE and some dense, or full recomputation keeps
more than one block per chunk or only the first blocks (`scalable` says; the exact trace is used then).
A probe's trace replays the fused loss and the CP ring from their first measurement with the same inputs'
shapes (replay.py: most of a trace's operators, the same bytes). tests/test_plan.py holds the probes'
numbers equal to the exact trace's.
"""
from __future__ import annotations

import dataclasses
from typing import Dict, Optional, Tuple

import torch

from ..model.layer_indices import block_layer_index, final_norm_index, is_block_index, lm_head_index
from .fake_rank import NO_CONVERSION, Conversion, TracedRank, stage_params, trace_activations
from .replay import Replays

# role -> (the probe's pipeline size, the probe's stage): a stage with the same neighbours
ROLES = {"only stage": (1, 0), "first stage": (2, 0), "middle stage": (3, 1), "last stage": (2, 1)}


def scalable(config, pp: int, virtual_stages: int = 1, partition_method: str = "uniform") -> bool:
    """Whether a stage of this layout is n identical blocks (n > 2) that the probes describe."""
    L = config.num_layers
    if virtual_stages != 1 or partition_method != "uniform" or L % pp or L // pp <= 2:
        return False
    if config.num_experts is not None and len({config.is_moe_layer(b) for b in range(L)}) > 1:
        return False
    return not (config.recompute_granularity == "full"
                and (config.recompute_method != "uniform" or config.recompute_num_layers != 1))


class Probes:
    """The probes of one model config and dtype, each built or traced once (a search's cache)."""

    def __init__(self, config, dtype: torch.dtype, conversion: Conversion = NO_CONVERSION,
                 replays: Optional[Replays] = None):
        self.config, self.dtype, self.conversion = config, dtype, conversion  # the run's converters (fake_rank.py)
        self.replays = replays or Replays()  # (a search shares one across its configs)
        self._params: Dict[tuple, tuple] = {}
        self._traces: Dict[tuple, Tuple[int, int, int]] = {}
        self._stages: Dict[tuple, tuple] = {}

    def _probe_config(self, role: str, blocks: int):
        return dataclasses.replace(self.config, num_layers=blocks * ROLES[role][0])

    def _degrees(self, role: str, tp: int, cp: int, ep: int) -> dict:
        return dict(tp=tp, pp=ROLES[role][0], cp=cp, ep=ep, etp=None)

    def params(self, role: str, tp: int, ep: int):
        key = (role, tp, ep)
        if key not in self._params:
            self._params[key] = stage_params(self._probe_config(role, 1), self._degrees(role, tp, 1, ep),
                                             ROLES[role][1], self.dtype, conversion=self.conversion)
        return self._params[key]

    def traced(self, role: str, tp: int, cp: int, micro_batch: int) -> bool:
        return (role, tp, cp, micro_batch) in self._traces

    def two_block_trace(self, role: str, tp: int, cp: int, micro_batch: int) -> Tuple[int, int, int]:
        """(saved, peak, one block's saved bytes) of the two-block probe, from its one trace: a block's saved
        bytes are the live bytes' growth over the second block's forward (its saved tensors and its output
        in place of its input's, the same size), which is saved(2) - saved(1) without the one-block trace."""
        key = (role, tp, cp, micro_batch)
        if key not in self._traces:
            marks = []
            with self.replays.installed():
                saved, peak = trace_activations(self._probe_config(role, 2), self._degrees(role, tp, cp, 1),
                                                ROLES[role][1], micro_batch, self.dtype, marks=marks,
                                                conversion=self.conversion)
            self._traces[key] = (saved, peak, marks[1] - marks[0])
        return self._traces[key]

    def rank(self, role: str, pp: int, pp_rank: int, degrees: dict, micro_batch: int,
             trace: bool = True) -> TracedRank:
        """Stage `pp_rank` of `pp` (of `role`) of the layout `degrees`, scaled from the probes."""
        n = self.config.num_layers // pp
        key = (role, pp, pp_rank, degrees["tp"], degrees["ep"])
        if key not in self._stages:
            self._stages[key] = self._scaled_params(self.params(role, degrees["tp"], degrees["ep"]), ROLES[role],
                                                    pp_rank * n, n)
        params = self._stages[key]
        if not trace:
            return TracedRank(params, 0, 0)
        saved2, peak2, per_block = self.two_block_trace(role, degrees["tp"], degrees["cp"], micro_batch)
        return TracedRank(params, saved2 + (n - 2) * per_block, peak2 + (n - 2) * per_block)

    def _scaled_params(self, probe, role_pp: Tuple[int, int], first_block: int, n: int):
        probe_layers, L = role_pp[0], self.config.num_layers
        renamed = {final_norm_index(probe_layers): final_norm_index(L), lm_head_index(probe_layers): lm_head_index(L)}
        before, block, after = [], [], []
        for param in probe:
            top, _, rest = param.name.partition(".")
            if top.isdigit() and is_block_index(int(top), probe_layers):
                block.append(param._replace(name=rest))
            else:
                if top.isdigit() and int(top) in renamed:
                    param = param._replace(name=f"{renamed[int(top)]}.{rest}")
                (after if block else before).append(param)
        blocks = [p._replace(name=f"{block_layer_index(b)}.{p.name}") for b in range(first_block, first_block + n)
                  for p in block]
        return tuple(before + blocks + after)
