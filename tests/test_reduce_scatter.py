"""megatron_zero.distributed.reduce_scatter: the list-form reduce-scatter, and the tensor-form fallback torch 2.4-2.6's gloo
needs, give each rank the exact sum of its part (fp32 integers: no rounding), sync and async, flat parts
(ZeRO buckets) and 3-D parts (TP sequence-parallel chunks). The fallback is forced so it runs on any torch."""
import pytest
import torch

from megatron_zero.distributed import reduce_scatter as rs
from megatron_zero.testing.multirank import run_ranks


def _parts(rank, world, shape):
    n = torch.Size(shape).numel()
    return [(torch.arange(n, dtype=torch.float32) + 1000 * r + 100 * rank).reshape(shape) for r in range(world)]


def _reduce(forced_fallback, shape, async_op):
    import torch.distributed as dist
    rank, world = dist.get_rank(), dist.get_world_size()
    if forced_fallback:
        rs.gloo_lacks_list_form = lambda group: True
    parts = _parts(rank, world, shape)
    out = torch.empty(shape)
    work = rs.reduce_scatter(out, parts, group=None, async_op=async_op)
    if async_op:
        work.wait()
    return out, rs.gloo_lacks_list_form(None)


@pytest.mark.parametrize("shape", [(6,), (2, 3, 4)], ids=["flat", "3d"])
@pytest.mark.parametrize("async_op", [False, True], ids=["sync", "async"])
def test_each_rank_gets_the_sum_of_its_part(shape, async_op):
    world = 2
    paths = [True] + [False] * (not (torch.__version__ < (2, 7)))  # the list form only where gloo has it
    for forced in paths:
        results = run_ranks(_reduce, world, forced, shape, async_op, timeout=120)
        for rank, (out, fell_back) in enumerate(results):
            want = sum(_parts(src, world, shape)[rank] for src in range(world))
            assert fell_back == forced
            assert torch.equal(out, want), (forced, rank)
