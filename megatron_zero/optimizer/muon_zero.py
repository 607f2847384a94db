"""Muon's step on ZeRO's flat fp32 partitions: each matrix orthogonalized once, by the data-parallel rank that owns
it whole, the result back on every rank's shard through the partition's own collectives.

A Muon param group is a flat fp32 group like AdamW's (zero/partition.py: stage 1/2 contiguous partitions, stage 3
per-parameter chunks; with expert parallelism the expert groups over expert-DP), so the momentum is a partition
too (saved as Adam's `exp_avg`, zero/checkpoint_state.py, and reshaped as it is). A step of group g:

    every rank:   W_r *= 1 - lr wd; m_r = lerp(m_r, G_r, 1 - mu); D_r = Nesterov's lerp(G_r, m_r, mu) or m_r
                  all_gather_into_tensor(D_0 .. D_dp-1)             the group's direction, whole, [dp, P]
    owner of W:   O = orthogonalized_update(D[W])  (muon.py)        once per matrix (per TP rank)
                  written at W's fragments into the gathered [dp, P], zeroed (one transient copy of the group)
    every rank:   reduce_scatter_tensor -> O_r                      one owner per element: x + 0 = x, exact
                  W_r -= lr O_r

Owners are assigned by Newton-Schulz FLOPs (muon_ownership.py) over the group's ranks; where the fragments of
each parameter lie on every rank is exchanged once, at construction (`owned_ranges` of every stage). At stage 0
(one replicated partition) every rank orthogonalizes every matrix. `work()` reports the FLOPs each rank was given
and, with `timed` set, this rank's seconds in Newton-Schulz.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import List, Optional

import torch
import torch.distributed as dist

from ..distributed import shm_comm
from ..distributed.device import HOST
from ..model.params import parse_expert_suffix
from .muon import MuonSettings, ns_flops, orthogonalized_update
from .muon_ownership import assign_owners, loads


@dataclass
class _GroupPlan:
    gi: int
    names: List[str]
    shapes: List[tuple]
    tp_groups: list             # per parameter: the group its TP shards are split over (None: whole)
    runs: List[list]            # per parameter: (rank, offset in param, offset in partition, numel)
    owner: List[int]            # per parameter: the DP rank that orthogonalizes it
    flops: List[int]            # per rank: the Newton-Schulz FLOPs it was given
    group: object               # the partition's process group (None: one partition)
    dp: int
    rank: int


def _partition_group(impl, gi: int):
    """(process group, ranks) the stage partitions group gi over (an expert stage: its half's)."""
    stage, i = impl._pick(gi) if hasattr(impl, "_pick") else (impl, gi)
    return (stage.dp_group, stage.dp) if stage.dp > 1 else (None, 1)


class MuonStep:
    def __init__(self, settings: MuonSettings, impl, named_groups, muon_groups: List[int], tp_group=None,
                 expert_tp_group=None):
        self.settings = settings
        self.groups = set(muon_groups)
        self.plans: List[_GroupPlan] = []
        self.ns_seconds = 0.0
        self.timed = False  # step() adds this rank's Newton-Schulz seconds to ns_seconds (bench; a host clock)
        for gi in muon_groups:
            names = [n for n, _ in named_groups[gi]]
            params = [p for _, p in named_groups[gi]]
            index = {id(p): i for i, p in enumerate(params)}
            shapes = [tuple(getattr(p, "ds_shape", p.shape)) for p in params]
            tp_groups = [(expert_tp_group or tp_group) if parse_expert_suffix(n.partition(".")[2]) else tp_group
                         for n in names]
            group, dp = _partition_group(impl, gi)
            mine = [(index[id(p)], a, s, n) for p, a, s, n in impl.owned_ranges(gi)]
            every = [mine]
            if dp > 1:
                every = [None] * dp
                dist.all_gather_object(every, mine, group=group)
            runs = [[] for _ in params]
            for r, ranges in enumerate(every):
                for i, a, s, n in ranges:
                    runs[i].append((r, a, s, n))
            costs = [ns_flops(n, shape, settings, _size(tpg)) for n, shape, tpg in zip(names, shapes, tp_groups)]
            owner = assign_owners(costs, dp)
            self.plans.append(_GroupPlan(gi, names, shapes, tp_groups, runs, owner, loads(costs, owner, dp), group,
                                         dp, dist.get_rank(group) if group is not None else 0))

    def adam_grads(self, grads: List[torch.Tensor]) -> List[Optional[torch.Tensor]]:
        """The gradients AdamW steps: the Muon groups' left out."""
        return [None if gi in self.groups else g for gi, g in enumerate(grads)]

    def work(self) -> dict:
        """Newton-Schulz FLOPs given to each rank of each Muon group's partition group, and this rank's seconds."""
        return {"flops_per_rank": [p.flops for p in self.plans], "ns_seconds": self.ns_seconds}

    @torch.no_grad()
    def step(self, flat_opt, grads: List[torch.Tensor]) -> None:
        """One Muon step of every Muon group's master (flat_opt: zero/offload.FlatAdamW, paged in)."""
        s = self.settings
        for plan in self.plans:
            master, grad = flat_opt.params[plan.gi], grads[plan.gi]
            hp = flat_opt.param_groups[plan.gi]
            st = flat_opt.opt.state[master]
            st.pop("exp_avg_sq", None)  # a loaded checkpoint's zeros: Muon keeps one state
            momentum = st.get("exp_avg")
            if momentum is None:
                momentum = st["exp_avg"] = torch.zeros_like(master.data)
            st["step"] = torch.tensor(float(flat_opt.steps[plan.gi] + 1), device=HOST)  # as FlatAdamW keeps it
            master.data.mul_(1 - hp["lr"] * hp["weight_decay"])
            momentum.lerp_(grad, 1 - s.momentum)
            direction = grad.lerp(momentum, s.momentum) if s.nesterov else momentum
            rows = direction.view(1, -1)
            if plan.dp > 1:
                rows = torch.empty(plan.dp * direction.numel(), device=direction.device)
                shm_comm.all_gather_into_tensor(rows, direction, plan.group)
                rows = rows.view(plan.dp, -1)
            start = time.perf_counter() if self.timed else 0.0
            updates = []  # this rank's matrices' updates (a 1/dp share of the group), then in place of `rows`
            for i, (name, shape) in enumerate(zip(plan.names, plan.shapes)):
                if plan.owner[i] != plan.rank:
                    continue
                whole = torch.empty(shape, device=rows.device).view(-1)
                for r, a, o, n in plan.runs[i]:
                    whole[a:a + n].copy_(rows[r, o:o + n])
                updates.append((i, orthogonalized_update(name, whole.view(shape), s, plan.tp_groups[i]).reshape(-1)))
            if self.timed:
                self.ns_seconds += time.perf_counter() - start
            out = rows if plan.dp > 1 else torch.empty_like(rows)  # the gathered direction is read: reused
            out.zero_()
            for i, update in updates:
                for r, a, o, n in plan.runs[i]:
                    out[r, o:o + n].copy_(update[a:a + n])
            mine = out[0]
            if plan.dp > 1:
                mine = torch.empty_like(direction)
                shm_comm.reduce_scatter_tensor(mine, out.view(-1), plan.group)
            master.data.add_(mine, alpha=-hp["lr"])


def _size(group) -> int:
    return dist.get_world_size(group) if group is not None else 1
