"""What the ZeRO stages with expert parallelism share (expert_stage.py: two Stage12, expert_stage3.py: two
Stage3): a dense half over the data-parallel group and an expert half over the expert-data-parallel group
behind one ZeroStage interface, the optimizer's param groups the dense groups then the expert groups, and
every per-group call sent to the half that holds the group."""
from __future__ import annotations

from typing import List

import torch


class ExpertHalves:
    def _init_halves(self, dense, expert, n_dense: int) -> None:
        self.dense, self.expert, self.n_dense = dense, expert, n_dense
        self.initial_masters = dense.initial_masters + expert.initial_masters
        del dense.initial_masters, expert.initial_masters

    def _pick(self, gi: int):
        return (self.dense, gi) if gi < self.n_dense else (self.expert, gi - self.n_dense)

    def finish_backward(self) -> None:
        self.dense.finish_backward()
        self.expert.finish_backward()

    def grad_partitions(self) -> List[torch.Tensor]:
        return self.dense.grad_partitions() + self.expert.grad_partitions()

    def weight_slices(self) -> List[torch.Tensor]:
        return self.dense.weight_slices() + self.expert.weight_slices()

    def write_weights(self, masters: List[torch.Tensor], fp8: bool = True) -> None:
        """`fp8` False: the FP8 layers published in the training dtype too (a checkpoint's)."""
        for half, mine in ((self.dense, masters[:self.n_dense]), (self.expert, masters[self.n_dense:])):
            gathers_fp8 = getattr(half, "packed", None) is not None or getattr(half, "gather8", None) is not None
            half.write_weights(*([mine] if fp8 or not gathers_fp8 else [mine, False]))

    def zero_grad(self) -> None:
        self.dense.zero_grad()
        self.expert.zero_grad()

    def owned_ranges(self, gi: int):
        stage, i = self._pick(gi)
        return stage.owned_ranges(i)

    def grad_bytes(self) -> int:
        return self.dense.grad_bytes() + self.expert.grad_bytes()

    def host_grad_bytes(self) -> int:
        return sum(getattr(h, "host_grad_bytes", lambda: 0)() for h in (self.dense, self.expert))

    def param_bytes(self) -> int:
        return self.dense.param_bytes() + self.expert.param_bytes()

    def remove_hooks(self) -> None:
        self.dense.remove_hooks()
        self.expert.remove_hooks()
