"""Topology as pure functions: every factorisation of 1, 2, 4 and 8 ranks."""
import pytest

from megatron_zero.testing.layouts import factorisations
from megatron_zero.distributed.topology import GROUP_KINDS, Layout, TopologyError


ALL_LAYOUTS = [lay for w in (1, 2, 4, 8) for lay in factorisations(w)]
EXPECTED_SIZE = {"tp": lambda lay: lay.tp, "dp": lambda lay: lay.dp, "pp": lambda lay: lay.pp,
                 "mp": lambda lay: lay.tp * lay.pp, "embedding": lambda lay: min(lay.pp, 2)}


def test_counts_factorisations():
    assert len(ALL_LAYOUTS) == 1 + 3 + 6 + 10


@pytest.mark.parametrize("layout", ALL_LAYOUTS, ids=str)
def test_coords_round_trip_and_order(layout):
    for r in range(layout.world_size):
        pp, dp, tp = layout.coords(r)
        assert layout.rank(pp, dp, tp) == r
        # TP fastest, then DP, then PP.
        assert r == pp * layout.dp * layout.tp + dp * layout.tp + tp
        assert layout.mp_coords(layout.mp_rank(r)) == (pp, tp)


@pytest.mark.parametrize("layout", ALL_LAYOUTS, ids=str)
@pytest.mark.parametrize("kind", GROUP_KINDS)
def test_groups_partition_the_world(layout, kind):
    groups = layout.all_groups(kind)
    size = EXPECTED_SIZE[kind](layout)
    assert all(len(g) == size for g in groups)
    members = sorted(r for g in groups for r in g)
    if kind == "embedding":
        # Only first and last stages belong to an embedding group.
        stages = {0, layout.pp - 1}
        assert members == sorted(r for r in range(layout.world_size) if layout.coords(r)[0] in stages)
    else:
        assert members == list(range(layout.world_size))  # each rank in exactly one group
    for r in range(layout.world_size):
        mine = getattr(layout, f"{kind}_group")(r)
        assert mine in groups
        if kind != "embedding" or layout.coords(r)[0] in (0, layout.pp - 1):
            assert r in mine


@pytest.mark.parametrize("layout", ALL_LAYOUTS, ids=str)
def test_group_contents(layout):
    for r in range(layout.world_size):
        pp, dp, tp = layout.coords(r)
        assert [layout.coords(x)[2] for x in layout.tp_group(r)] == list(range(layout.tp))
        assert all(layout.coords(x)[:2] == (pp, dp) for x in layout.tp_group(r))
        assert all(layout.coords(x)[0] == pp and layout.coords(x)[2] == tp for x in layout.dp_group(r))
        assert [layout.coords(x)[0] for x in layout.pp_group(r)] == list(range(layout.pp))
        assert all(layout.coords(x)[1] == dp for x in layout.mp_group(r))
        prev, nxt = layout.prev_stage_rank(r), layout.next_stage_rank(r)
        assert (prev is None) == (pp == 0) and (nxt is None) == (pp == layout.pp - 1)
        if nxt is not None:
            assert layout.prev_stage_rank(nxt) == r and layout.coords(nxt) == (pp + 1, dp, tp)


def test_megatron_order_example():
    # Megatron's docstring example: 16 ranks, TP=2, PP=4 -> DP=2.
    lay = Layout.from_world(16, tp=2, pp=4)
    assert lay.tp_group(0) == [0, 1] and lay.tp_group(14) == [14, 15]
    assert lay.dp_group(0) == [0, 2] and lay.dp_group(13) == [13, 15]
    assert lay.pp_group(0) == [0, 4, 8, 12] and lay.pp_group(3) == [3, 7, 11, 15]
    assert lay.embedding_group(5) == [1, 13]


def test_world_not_divisible_names_the_numbers():
    with pytest.raises(TopologyError) as err:
        Layout.from_world(6, tp=4, pp=1)
    msg = str(err.value)
    assert "6" in msg and "4" in msg and "1" in msg


def test_bad_sizes_and_ranks():
    with pytest.raises(TopologyError):
        Layout(tp=0)
    with pytest.raises(TopologyError):
        Layout(tp=2).coords(2)
