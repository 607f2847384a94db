"""The bytes ZeRO-1 moves per step (fp32, DP2), counted per collective (CollectiveCounter, torch.distributed's
collectives only: shared memory off): the gradient is reduce-scattered bucket by bucket, each rank receiving
its partition, so the buckets' inputs add up to the padded fp32 gradient G once and each rank sends
G * (DP - 1) / DP (ring); no all-reduce carries gradient (only the norm's scalars); the weights come back in
one in-place all-gather per group. --grad-reduce-in-bf16 halves the reduce-scatter bytes."""
import pytest
import torch
import torch.distributed as dist

from megatron_zero.distributed import shm_comm
from megatron_zero.testing import run_ranks
from megatron_zero.testing.collective_counter import CollectiveCounter
from megatron_zero.zero import ZeroOptimizer

DP, BUCKET = 2, 1000


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8))


def one_step(bf16_reduce, overlap):
    shm_comm.set_shared_memory_comm(False)
    net = model()
    opt = ZeroOptimizer(list(net.named_parameters()), dp_group=dist.group.WORLD, stage=1, bucket_size=BUCKET,
                        overlap_grad_reduce=overlap, grad_reduce_in_bf16=bf16_reduce)
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(dist.get_rank()))
    with CollectiveCounter() as seen:
        opt.arm_grad_reduce()
        opt.backward(net(x).pow(2).mean())
        updated, _ = opt.step()
    assert updated
    return seen.calls, opt.impl.parts[0].padded_numel


@pytest.mark.parametrize("bf16_reduce,overlap", [(False, False), (False, True), (True, False)])
def test_zero1_step_reduce_scatters_the_gradient_once(bf16_reduce, overlap):
    for calls, padded in run_ranks(one_step, DP, bf16_reduce, overlap, timeout=120):
        grad_bytes = padded * (2 if bf16_reduce else 4)
        scatters = [b for name, b in calls if name == "c10d::_reduce_scatter_base_"]  # (output, input)
        assert sum(inp for _, inp in scatters) == grad_bytes
        assert all(out * DP == inp for out, inp in scatters)
        sent = sum(inp * (DP - 1) // DP for _, inp in scatters)
        assert sent == grad_bytes * (DP - 1) // DP
        assert len(scatters) == -(-(padded // DP) // (BUCKET // DP))  # bucket_size / DP of each partition a bucket
        reduced = [sum(b) for name, b in calls if name == "c10d::allreduce_"]
        assert all(n <= 64 for n in reduced), reduced  # scalars (the norm), never the gradient
        gathers = [b for name, b in calls if name == "c10d::_allgather_base_"]  # (output, input)
        assert gathers == [(padded * 4, padded * 4 // DP)]  # the fp32 weights, in place
