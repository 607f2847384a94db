"""The global grad norm spans TP, PP and DP and counts TP-replicated parameters once, shared ones never."""
import math

import torch

from megatron_zero.testing import run_ranks
from megatron_zero.distributed.topology import build_parallel_state
from megatron_zero.zero import ZeroOptimizer


def norm_on_layout(stage):
    state = build_parallel_state(tp=2, pp=1)
    t = state.tp_rank
    sharded = torch.nn.Parameter(torch.zeros(6))
    sharded.tensor_model_parallel = True
    replicated = torch.nn.Parameter(torch.zeros(5))
    replicated.tensor_model_parallel = False
    shared = torch.nn.Parameter(torch.zeros(3))
    shared.tensor_model_parallel, shared.shared = True, True
    named = [("a", sharded), ("b", replicated), ("c", shared)]
    opt = ZeroOptimizer(named, dp_group=state.dp_group, stage=stage, mp_group=state.mp_group, tp_rank=t,
                        bucket_size=4, module=torch.nn.Module() if stage == 3 else None, lr=0.1)
    # gradients: a = t + 1 on each TP rank (different slices), b = 2 (the same copy), c = 100 (not counted)
    loss = (t + 1) * sharded.sum() + 2 * replicated.sum() + 100 * shared.sum()
    opt.backward(loss)
    return opt.step()[1]


def test_grad_norm_counts_each_element_once():
    want = math.sqrt(6 * 1 ** 2 + 6 * 2 ** 2 + 5 * 2 ** 2)
    for stage in (1, 2, 3):
        norms = run_ranks(norm_on_layout, 4, stage, timeout=120)
        assert all(abs(n - want) < 1e-9 * want for n in norms), (stage, norms, want)
