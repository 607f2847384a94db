"""Delayed scaling (Transformer Engine's DelayedScaling, Megatron-LM's default FP8 recipe) on torchao's casts.

Each FP8 layer keeps, for each operand it casts (its input x, its weight W, its output gradient g), a scale
(1 at the start) and an amax history of --fp8-amax-history-len entries, on the device. A cast multiplies
by the operand's current scale; then the tensor's amax, all-reduced (MAX) over the tensor-, context- and
data-parallel groups (Transformer Engine's amax reduction group: every rank of the pipeline stage), is
written into the history's slot 0 and the next scale is computed from the history, as Transformer Engine's
`_default_get_amax_and_update_history` / `_default_sf_compute` do: amax = the history's max (`max`) or
slot 0 (`most_recent`); scale = fp8_max / amax / 2^margin, the previous scale kept where amax is 0 or not
finite; the history rolled by one (slot 0 becomes the newest entry at the end) and slot 0 zeroed. So a
step's cast uses the scale of the amaxes up to the previous micro-batch, as Transformer Engine's (its
update runs when the forward's autocast exits and when the backward ends). The backward casts x and W
again with the forward's scales (Transformer Engine keeps the forward's FP8 copies) and g twice with one
scale: one history entry per operand per micro-batch. Nothing here reads a value back to the host.

The amaxes are reduced together, as Transformer Engine does (its global amax buffer): a cast's local amax
waits (`defer`) until the next cast of the same operand of the same layer (its next micro-batch) or a read
of the histories (`histories`, the checkpoint's state) needs it; then every waiting amax of the model is
reduced at once (`AmaxReductions.flush`), one all-reduce per group over the stacked amaxes that reduce over
the same groups, and recorded. Every cast still sees the history it would see with one reduction per cast (its
own operand's amaxes are all in), so the scales are the same; the collectives per step fall from up to three
per cast to a few per micro-batch. The buffer is the model's (the converter gives its layers one), not the
process's: a flush reduces that model's amaxes over that model's groups only, at a cast of that model, which
every rank of its stage reaches; another model of the same process (a reference, a second layout, a layer
used alone) neither flushes them nor is flushed by them.

The histories and scales are training state: `checkpoint_scaling_state(model, dp_group)` (with every DP
rank's MoE experts') / `load_scaling_state(model, saved)` carry them in the checkpoint's model-states file
(megatron_zero/checkpoint/), not in the model's state dict, so the layer files and every export stay those
of a bf16 run.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from .experts import is_expert
from .settings import ALGOS  # noqa: F401  (re-exported: the amax algorithms AmaxHistory takes)

OPERANDS = {"x": 0, "w": 1, "g": 2}
STATE_KEY = "fp8_delayed_scaling"  # the model-states file's entry


class AmaxHistory:
    """One layer's delayed-scaling state: per operand (OPERANDS) an amax history and the scale it gives."""

    def __init__(self, length: int, algo: str, margin: int, device: torch.device,
                 reductions: Optional["AmaxReductions"] = None):
        """`reductions`: the model's buffer of waiting amaxes, shared by its layers (None: this layer's own)."""
        self.algo, self.margin = algo, margin
        self.history = torch.zeros(len(OPERANDS), length, device=device)
        self.scale = torch.ones(len(OPERANDS), device=device)
        self.reductions = AmaxReductions() if reductions is None else reductions

    def scale_for(self, operand: str) -> torch.Tensor:
        """The scale this cast multiplies by (a copy: the update below changes the state in place); the
        waiting amaxes reduced first when one of them is this operand's."""
        if (self, OPERANDS[operand]) in self.reductions.waiting:
            self.reductions.flush()
        return self.scale[OPERANDS[operand]].clone()

    def defer(self, operand: str, amax: torch.Tensor, fp8_max: float, groups: Tuple) -> None:
        """Record this cast's local `amax` once it is reduced (MAX) over `groups` with the others waiting."""
        self.reductions.waiting[(self, OPERANDS[operand])] = (amax.float().reshape(()), fp8_max, groups)

    @torch.no_grad()
    def record(self, operand, amax: torch.Tensor, fp8_max: float) -> None:
        """The cast's reduced amax into the history, then the next scale from the history (TE's order).
        `operand`: its name or index."""
        i = OPERANDS.get(operand, operand)
        history, scale = self.history[i], self.scale[i]
        history[0] = amax.float()
        new_amax = history.max() if self.algo == "max" else history[0].clone()
        sf = fp8_max / new_amax / 2.0 ** self.margin
        sf = torch.where(new_amax > 0, sf, scale)
        scale.copy_(torch.where(torch.isfinite(new_amax), sf, scale))
        if history.numel() > 1:
            history.copy_(torch.roll(history, -1))
        history[0] = 0.0


class AmaxReductions:
    """One model's casts' amaxes waiting to be reduced: (history, operand index) -> (local amax, fp8 max, the
    groups it reduces over), in the order of the casts."""

    def __init__(self):
        self.waiting: Dict[Tuple[AmaxHistory, int], Tuple[torch.Tensor, float, Tuple]] = {}

    @torch.no_grad()
    def flush(self) -> None:
        """Reduce every waiting amax (one all-reduce per group for the amaxes sharing their groups) and record
        them. Collective over those groups: every rank of a stage waits for the same casts' amaxes."""
        by_groups: Dict[Tuple, List] = {}
        for key, (amax, fp8_max, groups) in self.waiting.items():
            by_groups.setdefault(groups, []).append((key, amax, fp8_max))
        self.waiting.clear()
        for groups, entries in by_groups.items():
            amaxes = torch.stack([amax for _, amax, _ in entries])
            for group in groups:
                dist.all_reduce(amaxes, op=dist.ReduceOp.MAX, group=group)
            for k, ((history, i), _, fp8_max) in enumerate(entries):
                history.record(i, amaxes[k], fp8_max)


def histories(model: torch.nn.Module):
    """(module name, AmaxHistory) of every delayed-scaling FP8 layer of the model, the model's waiting amaxes
    recorded first (collective where some wait: every rank of a stage reads them at the same point)."""
    found = [(name, state) for name, module in model.named_modules()
             if (state := getattr(getattr(module, "fp8", None), "delayed", None)) is not None]
    for reductions in {id(s.reductions): s.reductions for _, s in found}.values():
        reductions.flush()
    yield from found


def scaling_state(model: torch.nn.Module) -> Optional[dict]:
    """The model's delayed-scaling state for a checkpoint (host copies), or None without delayed scaling."""
    out = {name: {"amax_history": s.history.detach().cpu().clone(), "scale": s.scale.detach().cpu().clone()}
           for name, s in histories(model)}
    return out or None


def checkpoint_scaling_state(model: torch.nn.Module, dp_group) -> Optional[dict]:
    """scaling_state for the model-states file the first DP rank writes, with the MoE experts' histories of
    every rank of the data-parallel group: under expert parallelism each holds other experts (the blocks'
    dense layers' are the same on every DP rank). Collective over `dp_group`."""
    mine = scaling_state(model)
    if mine is None or dp_group is None or dist.get_world_size(dp_group) == 1:
        return mine
    experts = {name for name, m in model.named_modules() if getattr(m, "fp8", None) is not None and is_expert(m)}
    every = [None] * dist.get_world_size(dp_group)
    dist.all_gather_object(every, {n: s for n, s in mine.items() if n in experts}, group=dp_group)
    for theirs in every:
        mine.update(theirs)
    return mine


def load_scaling_state(model: torch.nn.Module, saved: Optional[dict]) -> Optional[str]:
    """Restore what checkpoint_scaling_state saved (the same layout: the same layers, the same history
    length; the saved experts may be more than this rank's); -> None when restored or when the model has no
    delayed scaling, else the one line saying the histories start fresh and why."""
    mine = dict(histories(model))
    if not mine:
        return None
    if not saved:
        return fresh_line("the checkpoint holds none (saved without delayed scaling)")
    if not set(mine) <= set(saved) or any(saved[n]["amax_history"].shape != s.history.shape
                                          for n, s in mine.items()):
        return fresh_line("the checkpoint's layers or --fp8-amax-history-len differ from this run's")
    for name, s in mine.items():
        s.history.copy_(saved[name]["amax_history"])
        s.scale.copy_(saved[name]["scale"])
    return None


def fresh_line(why: str) -> str:
    return (f"FP8 delayed scaling: the amax histories start fresh (scale 1), {why}; only the first steps' "
            "scales differ from a run that kept them")
