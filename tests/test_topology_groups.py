"""Process groups on real gloo ranks: collective sums over each group give the expected values."""
import pytest
import torch
import torch.distributed as dist

from megatron_zero.testing import run_ranks
from megatron_zero.testing.layouts import factorisations
from megatron_zero.distributed.topology import GROUP_KINDS, build_parallel_state


def check_all_layouts(world):
    rank = dist.get_rank()
    checked = []
    for layout in factorisations(world):
        state = build_parallel_state(tp=layout.tp, pp=layout.pp)
        assert state.layout == layout
        for kind in GROUP_KINDS:
            members = getattr(layout, f"{kind}_group")(rank)
            if rank not in members:
                continue  # middle pipeline stages hold no embedding
            group = state.groups[kind]
            assert dist.get_world_size(group) == len(members)
            value = torch.tensor([float(rank + 1), 1.0])
            dist.all_reduce(value, group=group)
            assert value.tolist() == [float(sum(m + 1 for m in members)), float(len(members))], (kind, layout)
        checked.append(str(layout))
    return checked


@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_group_collectives(world):
    results = run_ranks(check_all_layouts, world, world, timeout=240)
    expected = [str(lay) for lay in factorisations(world)]
    assert results == [expected] * world
