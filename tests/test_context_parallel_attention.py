"""Context-parallel attention (ring p2p and all-gather) against the whole-sequence causal attention, forward
and backward, fp32: CP 2 and 4, grouped-query (2 KV groups for 4 query heads) and plain multi-head, and
the load-balanced chunking as pure functions. The attention is a short chain of sums (scores over the head
dim d, the softmax and context over s keys; backward the same again), so both sides are fp32 evaluations
of one expression in another order: normwise within model_rtol(n), n = 4 (d + s)."""
import pytest
import torch
import torch.distributed as dist

from megatron_zero.context_parallel import block_attention, context_parallel_attention, cp_positions, slice_sequence_for_cp
from megatron_zero.model.attention_core import attention_core
from megatron_zero.model.transformer import expand_kv_heads
from megatron_zero.testing import run_ranks
from megatron_zero.testing.tolerances import assert_close_normwise, model_rtol

B, HEADS, SEQ, D = 2, 4, 16, 8


def test_positions_balance_the_causal_work():
    assert cp_positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert cp_positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    for cp in (1, 2, 4):
        owned = torch.cat([cp_positions(16, cp, r) for r in range(cp)])
        assert sorted(owned.tolist()) == list(range(16))
        work = [int((cp_positions(16, cp, r) + 1).sum()) for r in range(cp)]  # keys each rank's queries see
        assert len(set(work)) == 1
    t = torch.arange(16).view(1, 16)
    assert slice_sequence_for_cp(t, 4, 1).tolist() == [[2, 3, 12, 13]]
    with pytest.raises(ValueError, match="not a multiple of 2 x context-parallel size 4"):
        cp_positions(12, 4, 0)


def inputs(groups):
    g = torch.Generator().manual_seed(7 + groups)
    q = torch.randn(B, HEADS, SEQ, D, generator=g)
    k, v = (torch.randn(B, groups, SEQ, D, generator=g) for _ in range(2))
    dout = torch.randn(B, HEADS, SEQ, D, generator=g)
    return q, k, v, dout


def unfused(q, k, v):
    return attention_core(q, k, v, "unfused", 0.0, True)


def reference(groups):
    q, k, v, dout = (t.requires_grad_() for t in inputs(groups))
    out = unfused(q, expand_kv_heads(k, HEADS), expand_kv_heads(v, HEADS))
    out.backward(dout.detach())
    return out.detach(), q.grad, k.grad, v.grad


def cp_run():
    """Every (comm type, KV groups) case on this rank's share of the sequence, in one launch; blocks are
    computed 3 queries at a time, so every block of 2-8 local queries is cut into uneven pieces."""
    block_attention.QUERY_ROWS = 3
    cp, r = dist.get_world_size(), dist.get_rank()
    out = {}
    for case in CASES:
        comm_type, groups = case
        q, k, v, dout = (slice_sequence_for_cp(t, cp, r, dim=2) for t in inputs(groups))
        q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
        context = context_parallel_attention(q, k, v, dist.group.WORLD, comm_type, core=unfused)
        context.backward(dout)
        out[case] = (context.detach(), q.grad, k.grad, v.grad)
    return out


CASES = [(comm_type, groups) for comm_type in ("p2p", "all_gather", "a2a") for groups in (2, 4)]


@pytest.fixture(scope="module", params=[2, 4], ids=["cp2", "cp4"])
def cp_runs(request):
    return request.param, run_ranks(cp_run, request.param)


@pytest.mark.parametrize("case", CASES, ids=[f"{c}-groups{g}" for c, g in CASES])
def test_matches_whole_sequence_attention(cp_runs, case):
    cp, per_rank = cp_runs
    comm_type, groups = case
    want = reference(groups)
    rtol = model_rtol(4 * (D + SEQ))
    for name, index in (("out", 0), ("dq", 1), ("dk", 2), ("dv", 3)):
        got = torch.cat([per_rank[r][case][index] for r in range(cp)], dim=2)
        mine = torch.cat([slice_sequence_for_cp(want[index], cp, r, dim=2) for r in range(cp)], dim=2)
        assert_close_normwise(got, mine, rtol, f"{comm_type} CP{cp} groups {groups} {name}")

def test_each_cp_rank_draws_its_own_dropout_masks():
    from megatron_zero.tensor_parallel import get_rng_tracker
    from megatron_zero.tensor_parallel.random import model_parallel_seed

    def draws(**ranks):
        model_parallel_seed(1234, **ranks)
        with get_rng_tracker().fork():
            per_tp = torch.rand(8)
        return torch.rand(8), per_tp

    without_cp = draws(tp_rank=1, pp_rank=1)
    assert all(torch.equal(a, b) for a, b in zip(draws(tp_rank=1, pp_rank=1, cp_rank=0), without_cp))
    assert not any(torch.equal(a, b) for a, b in zip(draws(tp_rank=1, pp_rank=1, cp_rank=1), without_cp))
