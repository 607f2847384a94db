"""QK-clip (Kimi K2's MuonClip; Megatron-LM's --qk-clip, --qk-clip-alpha, --qk-clip-threshold,
--log-max-attention-logit): each attention head's max attention logit over a step's forward passes, reduced (MAX)
over DP x CP; after the optimizer's update, where a query group's max S passes the threshold t, its q rows are
scaled by eta^alpha and its k rows by eta^(1 - alpha), eta = min(t / S, 1), so that its logits come back to t.

Generic over the attention: a target is "an attention module reporting its per-head max logit and the
multipliers of its q / k weights" (`QKClipTarget`): `max_logit` (a `MaxLogit` its forward feeds with q and k) and
`multipliers(eta, alpha)` -> {parameter: a tensor of its shape}. `targets(model)` adapts the fused-QKV attention
of model/transformer.py (per query group [q heads, k, v] rows; the QKV bias scaled as its rows); another attention
(Multi-Latent Attention's q / k projections) plugs in with an adapter of its own.

The scaling is applied to the fp32 masters, on each rank's ZeRO fragments (ZeroOptimizer.after_update, before
the step's weights are published: no extra gather), with eta = 1 (an exact no-op) where the threshold is not
passed, so no host read decides it. The max logit comes from q and k (after RoPE) by query blocks whatever the
attention backend (flash never builds the scores): one more q k^T a layer while the flags are on; with context
parallelism each rank's queries against every CP rank's keys (all-gathered, positions from the load-balanced
chunks).
"""
from __future__ import annotations

from typing import Dict, List, Protocol

import torch
import torch.distributed as dist

from ..distributed import shm_comm

QUERY_BLOCK = 256


class MaxLogit:
    """One attention module's per-head max logit (this rank's heads) since the last reset, on the device."""

    def __init__(self, heads: int, scale: float, device):
        self.scale = scale
        self.value = torch.full((heads,), float("-inf"), device=device)

    @torch.no_grad()
    def record(self, q: torch.Tensor, k: torch.Tensor, cp_group=None) -> None:
        """q [b, heads, s, hd], k [b, heads or query groups, s, hd] (after RoPE): the causal max of q k^T scale."""
        from ..model.transformer import local_positions
        s = q.shape[2]
        positions = local_positions(s, cp_group, q.device) if cp_group is not None else torch.arange(s, device=q.device)
        keys, key_positions = k, positions
        if cp_group is not None:
            cp = dist.get_world_size(cp_group)
            gathered = [torch.empty_like(k) for _ in range(cp)]
            dist.all_gather(gathered, k.contiguous(), group=cp_group)
            where = [torch.empty_like(positions) for _ in range(cp)]
            dist.all_gather(where, positions, group=cp_group)
            keys, key_positions = torch.cat(gathered, dim=2), torch.cat(where)
        keys = keys.repeat_interleave(q.shape[1] // keys.shape[1], dim=1)
        for start in range(0, s, QUERY_BLOCK):
            block = q[:, :, start:start + QUERY_BLOCK]
            scores = torch.matmul(block.float(), keys.float().transpose(-1, -2)) * self.scale
            hidden = key_positions[None, :] > positions[start:start + QUERY_BLOCK, None]
            scores.masked_fill_(hidden, float("-inf"))
            self.value = torch.maximum(self.value, scores.amax(dim=(0, 2, 3)))

    def reset(self) -> None:
        self.value.fill_(float("-inf"))


class QKClipTarget(Protocol):
    max_logit: MaxLogit

    def multipliers(self, eta: torch.Tensor, alpha: float) -> Dict[torch.nn.Parameter, torch.Tensor]:
        """What to multiply its q / k parameters by, given each local head's eta."""


class FusedQKVTarget:
    """model/transformer.py's ParallelAttention: its local QKV rows per query group [q heads, k, v] x head_dim."""

    def __init__(self, attention):
        split = attention.split_qkv
        if split.gather:
            raise ValueError("QK-clip needs whole query groups on each TP rank (--num-query-groups at least TP)")
        self.groups, self.per_group, self.head_dim = split.local_groups, split.heads_per_group, split.head_dim
        self.weight = attention.query_key_value.weight
        self.bias = attention.query_key_value.bias
        device = self.weight.device
        attention.max_logit = self.max_logit = MaxLogit(split.local_heads, split.head_dim ** -0.5, device)

    def multipliers(self, eta, alpha):
        per_group = eta.view(self.groups, self.per_group).amin(dim=1)  # the group's largest logit sets its eta
        rows = torch.ones(self.groups, self.per_group + 2, self.head_dim, device=eta.device)
        rows[:, :self.per_group] = per_group.pow(alpha)[:, None, None]
        rows[:, self.per_group] = per_group.pow(1 - alpha)[:, None]
        rows = rows.reshape(-1)
        out = {self.weight: rows[:, None].expand(rows.numel(), _columns(self.weight))}
        if self.bias is not None:
            out[self.bias] = rows
        return out


def _columns(p) -> int:
    return tuple(getattr(p, "ds_shape", p.shape))[1]


def targets(model) -> List[QKClipTarget]:
    from ..model.transformer import ParallelAttention
    return [FusedQKVTarget(m) for m in model.modules() if isinstance(m, ParallelAttention)]


class QKClip:
    """Registered with ZeroOptimizer.after_update: reduce, clip (with --qk-clip), reset; `report()` the max."""

    def __init__(self, model, optimizer, dp_group, clip: bool, alpha: float, threshold: float):
        self.targets, self.optimizer, self.dp_group = targets(model), optimizer, dp_group
        self.clip, self.alpha, self.threshold = clip, alpha, threshold
        self.last = None  # the last step's max logit over this rank's layers (device scalar)
        self._fragments = None
        optimizer.after_update.append(self.after_update)

    def _where(self):
        """Per group: (offset in the master partition, offset in the parameter, numel, parameter) of q/k params."""
        if self._fragments is None:
            watched = {id(p) for t in self.targets for p in t.multipliers(t.max_logit.value.new_ones(
                t.max_logit.value.numel()), self.alpha)}
            self._fragments = [[(s, a, n, p) for p, a, s, n in self.optimizer.impl.owned_ranges(gi) if id(p) in watched]
                               for gi in range(len(self.optimizer.names))]
        return self._fragments

    @torch.no_grad()
    def after_update(self, masters) -> None:
        if not self.targets:
            return
        logits = torch.stack([t.max_logit.value for t in self.targets])
        if self.dp_group is not None and dist.get_world_size(self.dp_group) > 1:
            shm_comm.all_reduce(logits, self.dp_group, op=dist.ReduceOp.MAX)
        self.last = logits.max()
        if self.clip:
            scale = {}
            for t, row in zip(self.targets, logits):
                eta = torch.where(row > self.threshold, self.threshold / row, torch.ones_like(row))
                scale.update({id(p): m for p, m in t.multipliers(eta, self.alpha).items()})
            for master, fragments in zip(masters, self._where()):
                for s, a, n, p in fragments:
                    master.data[s:s + n].mul_(scale[id(p)].reshape(-1)[a:a + n])
        for t in self.targets:
            t.max_logit.reset()

    def report(self, mp_group) -> float:
        """The last step's max attention logit over the model (MAX over the model-parallel group; a host read)."""
        nothing_yet = torch.full((1,), float("nan"), device=self.optimizer.device)  # no step updated yet
        value = self.last.reshape(1).clone() if self.last is not None else nothing_yet
        if mp_group is not None and dist.get_world_size(mp_group) > 1:
            shm_comm.all_reduce(value, mp_group, op=dist.ReduceOp.MAX)
        return float(value)
