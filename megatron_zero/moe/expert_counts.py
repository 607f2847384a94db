"""The expert count's one check, asked by the MoE flags (config/moe.py); GPTConfig and the MoE layers trust the
checked count (a layer holds num_experts / EP experts)."""
from __future__ import annotations


class ExpertCountError(ValueError):
    """An expert count the layout or the router cannot use (one sentence)."""


def check_expert_counts(num_experts: int, topk: int, ep: int = 1) -> None:
    """The one check of the expert count: a positive multiple of the expert-parallel size `ep`, at least the
    top-k."""
    if num_experts < 1 or num_experts % ep:
        raise ExpertCountError(f"--num-experts {num_experts} must be a positive multiple of --expert-model-parallel-size {ep}")
    if not 1 <= topk <= num_experts:
        raise ExpertCountError(f"--moe-router-topk {topk} must lie in 1..--num-experts {num_experts}")
