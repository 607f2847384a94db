"""The 1F1B schedule on a toy pipeline (one Linear per stage) against a single process."""
import pytest
import torch
import torch.distributed as dist

from megatron_zero.pipeline.p2p import P2P
from megatron_zero.pipeline.schedule import ScheduleStats, broadcast_loss, forward_backward
from megatron_zero.testing import run_ranks
from megatron_zero.testing.toy_pipeline import H, MB, toy_batches, toy_layers, toy_reference
from megatron_zero.distributed.topology import build_parallel_state


def pipelined(m):
    state = build_parallel_state(tp=1, pp=dist.get_world_size())
    stage, pp = state.pp_rank, state.pp_size
    layer = toy_layers(pp)[stage]
    batches = toy_batches(m)

    def forward_step(i, x):
        inp = batches[i][0] if stage == 0 else x
        y = torch.tanh(layer(inp))
        return torch.nn.functional.mse_loss(y, batches[i][1]) / m if state.is_last_stage else y

    stats = ScheduleStats()
    p2p = P2P(state.prev_rank, state.next_rank, (MB, H), torch.float32)
    losses = forward_backward(forward_step, m, p2p, stage, pp, stats=stats)
    loss = broadcast_loss(losses, state.is_last_stage, state.layout.pp_group(state.rank)[-1], state.pp_group)
    return loss, layer.weight.grad, stats.max_in_flight


@pytest.mark.parametrize("pp,m", [(2, 4), (4, 6), (4, 4), (3, 2)])
def test_1f1b_matches_single_process(pp, m):
    ref_loss, ref_grads = toy_reference(pp, m)
    results = run_ranks(pipelined, pp, m, timeout=120)
    for stage, (loss, grad, in_flight) in enumerate(results):
        assert loss == pytest.approx(ref_loss, rel=1e-6)  # every rank reports the loss
        torch.testing.assert_close(grad, ref_grads[stage], rtol=1e-6, atol=1e-7)
        assert in_flight <= pp - stage  # activations held by stage s: at most pp - s micro-batches
        assert in_flight == min(pp - stage, m)
