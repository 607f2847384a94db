"""Context-parallel attention (ring p2p, all-gather, a2a and hierarchical a2a+p2p) against the whole-sequence causal attention, forward
and backward, fp32: CP 2 and 4, grouped-query (2 KV groups for 4 query heads) and plain multi-head, and
the load-balanced chunking as pure functions. The attention is a short chain of sums (scores over the head
dim d, the softmax and context over s keys; backward the same again), so both sides are fp32 evaluations
of one expression in another order: normwise within model_rtol(n), n = 4 (d + s).

Attention dropout (p2p and all_gather): the mask of probability (i, j) is a hash of (seed, sample, head,
positions i and j), so the reference applies the same mask to the whole sequence's softmax (identical-mask
construction) and the bound is the one without dropout; the mask's kept share is checked against the
binomial distribution.

p2p and a2a+p2p run their blocks by torch's flash kernel (the default, `auto`) and, in the cases named
"unfused", by block_attention's query pieces; the same bound holds for both.

a2a+p2p runs with all-to-all groups of A = 1 and 2 consecutive ranks (at CP4, A = 2: two groups, each then a
ring of 2), the groups built by topology.hierarchical_cp_ranks as build_parallel_state builds them."""
import dataclasses

import pytest
import torch
import torch.distributed as dist

from megatron_zero.context_parallel import (all_gather_attention, block_attention, context_parallel_attention,
                                            cp_positions, ring_attention, slice_sequence_for_cp)
from megatron_zero.model.attention_core import attention_core
from megatron_zero.model.transformer import expand_kv_heads
from megatron_zero.testing import run_ranks
from megatron_zero.testing.tolerances import assert_close_normwise, model_rtol
from megatron_zero.distributed.topology import hierarchical_cp_ranks

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


DROPOUT = block_attention.Dropout(0.3, 1234)


def dropped_attention(q, k, v):
    """The whole-sequence causal attention with DROPOUT's masks on the probabilities."""
    scores = torch.matmul(q, k.transpose(-2, -1)) / D ** 0.5
    scores = scores.masked_fill(torch.ones(SEQ, SEQ, dtype=torch.bool).triu(1), float("-inf"))
    positions = torch.arange(SEQ)
    keep = block_attention.keep_mask(DROPOUT, B, HEADS, positions, positions)
    return torch.matmul(torch.softmax(scores, dim=-1) * keep / (1 - DROPOUT.p), v)


def reference(groups, dropout=False):
    q, k, v, dout = (t.requires_grad_() for t in inputs(groups))
    out = (dropped_attention if dropout else unfused)(q, expand_kv_heads(k, HEADS), expand_kv_heads(v, HEADS))
    out.backward(dout.detach())
    return out.detach(), q.grad, k.grad, v.grad


def cp_run():
    """Every (comm type, KV groups) case on this rank's share of the sequence, in one launch; blocks are
    computed 3 queries at a time, so every block of 2-8 local queries is cut into uneven pieces."""
    block_attention.QUERY_ROWS = 3
    cp, r = dist.get_world_size(), dist.get_rank()
    out = {}
    ranks = list(range(cp))
    hierarchy = {a: _hierarchy(ranks, a, r) for a in sorted({case[2] for case in HIERARCHICAL})}
    for case in ALL:
        comm_type, groups = case[:2]
        q, k, v, dout = (slice_sequence_for_cp(t, cp, r, dim=2) for t in inputs(groups))
        q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
        if case in DROPOUT_CASES and comm_type == "p2p":
            context = ring_attention.ring_attention(q, k, v, SEQ, dist.group.WORLD, ranks, r, DROPOUT)
        elif case in DROPOUT_CASES:
            context = all_gather_attention.all_gather_attention(q, k, v, SEQ, dist.group.WORLD, cp, r, DROPOUT)
        elif comm_type == "a2a+p2p":
            context = context_parallel_attention(q, k, v, dist.group.WORLD, comm_type, hierarchy=hierarchy[case[2]],
                                                 backend=case[-1] if case in BLOCK_CASES else "auto")
        else:
            context = context_parallel_attention(q, k, v, dist.group.WORLD, comm_type, core=unfused,
                                                 backend=case[-1] if case in BLOCK_CASES else "auto")
        context.backward(dout)
        out[case] = (context.detach(), q.grad, k.grad, v.grad)
    return out


CASES = [(comm_type, groups) for comm_type in ("p2p", "all_gather", "a2a") for groups in (2, 4)]
DROPOUT_CASES = [(comm_type, 2, "dropout") for comm_type in ("p2p", "all_gather")]
HIERARCHICAL = [("a2a+p2p", groups, a) for groups in (2, 4) for a in (1, 2)]  # a: the all-to-all group's size
BLOCK_CASES = [("p2p", 2, "unfused"), ("a2a+p2p", 2, 2, "unfused")]  # the rings' blocks by query pieces


def _hierarchy(ranks, a, rank):
    """(all-to-all group, ring group) of `rank`; every rank creates every group in the same order."""
    a2a_groups, p2p_groups = hierarchical_cp_ranks(ranks, a)
    mine = []
    for groups in (a2a_groups, p2p_groups):
        made = [(g, dist.new_group(g)) for g in groups]
        mine.append(next(group for g, group in made if rank in g))
    return tuple(mine)


@pytest.fixture(scope="module", params=[2, 4], ids=["cp2", "cp4"])
def cp_runs(request):
    return request.param, run_ranks(cp_run, request.param)


ALL = CASES + DROPOUT_CASES + HIERARCHICAL + BLOCK_CASES


@pytest.mark.parametrize("case", ALL, ids=["-".join(map(str, c)) for c in ALL])
def test_matches_whole_sequence_attention(cp_runs, case):
    cp, per_rank = cp_runs
    comm_type, groups = case[:2]
    want = reference(groups, dropout=case in DROPOUT_CASES)
    rtol = model_rtol(4 * (D + SEQ))
    for name, index in (("out", 0), ("dq", 1), ("dk", 2), ("dv", 3)):
        got = torch.cat([per_rank[r][case][index] for r in range(cp)], dim=2)
        mine = torch.cat([slice_sequence_for_cp(want[index], cp, r, dim=2) for r in range(cp)], dim=2)
        assert_close_normwise(got, mine, rtol, f"{comm_type} CP{cp} groups {groups} {name}")

def test_dropout_masks_keep_the_share_1_minus_p():
    """Over 2 x 4 x 256 x 256 draws the kept share is within 6 binomial standard deviations of 1 - p, and
    masks of another seed, head or position differ."""
    positions = torch.arange(256)
    keep = block_attention.keep_mask(DROPOUT, 2, 4, positions, positions)
    n, p = keep.numel(), DROPOUT.p
    assert abs(keep.float().mean().item() - (1 - p)) <= 6 * (p * (1 - p) / n) ** 0.5
    other = block_attention.keep_mask(block_attention.Dropout(p, 1235), 2, 4, positions, positions)
    assert 0.3 < (keep != other).float().mean().item() < 0.5  # independent masks differ in 2 p (1 - p) = 0.42
    assert 0.3 < (keep[:, 0] != keep[:, 1]).float().mean().item() < 0.5
    assert 0.3 < (keep[..., :128, :] != keep[..., 128:, :]).float().mean().item() < 0.5
    assert torch.equal(keep[..., 5:9, 100:140], block_attention.keep_mask(DROPOUT, 2, 4, positions[5:9],
                                                                          positions[100:140]))


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


def dropout_gradients():
    """A 2-layer Llama at CP2 with attention dropout 0.3: the gradients without recomputation, with selective
    and with full recomputation, each from the same RNG state."""
    from megatron_zero.model.gpt import GPTModel
    from megatron_zero.tensor_parallel.random import model_parallel_seed
    from megatron_zero.testing.tiny_gpt import tiny_llama_config
    from megatron_zero.distributed.topology import build_parallel_state

    state = build_parallel_state(cp=2)
    whole = torch.randint(0, 100, (1, 17), generator=torch.Generator().manual_seed(3))
    tokens, labels = (slice_sequence_for_cp(t, 2, state.cp_rank) for t in (whole[:, :-1], whole[:, 1:]))
    grads = []
    for recompute in ({}, dict(recompute_granularity="selective"),
                      dict(recompute_granularity="full", recompute_method="uniform")):
        for comm_type in ("p2p", "all_gather"):
            model_parallel_seed(5, cp_rank=state.cp_rank)
            config = tiny_llama_config(2, seq_length=16, max_position_embeddings=16, attention_dropout=0.3,
                                       cp_comm_type=comm_type, **recompute)
            net = GPTModel(config, cp_group=state.cp_group)
            model_parallel_seed(6, cp_rank=state.cp_rank)
            net(tokens, labels=labels).backward()
            grads.append(torch.cat([p.grad.flatten() for p in net.parameters()]))
            if not recompute:  # and without dropout, to see that it acts
                model_parallel_seed(5, cp_rank=state.cp_rank)
                net = GPTModel(dataclasses.replace(config, attention_dropout=0.0), cp_group=state.cp_group)
                net(tokens, labels=labels).backward()
                grads.append(torch.cat([p.grad.flatten() for p in net.parameters()]))
    return grads


def test_dropout_masks_are_replayed_by_recomputation():
    """The seed is drawn inside the RNG tracker's fork, which recomputation restores: selective and full
    recomputation give the gradients of the run without it (fp32: the same operations, bit for bit, except
    the recomputed forward's reductions, which run the same kernels on the same inputs)."""
    for grads in run_ranks(dropout_gradients, 2):
        none_p2p, no_dropout_p2p, none_ag, no_dropout_ag = grads[:4]
        assert not torch.equal(none_p2p, no_dropout_p2p) and not torch.equal(none_ag, no_dropout_ag)
        for i, got in enumerate(grads[4:]):
            want = none_p2p if i % 2 == 0 else none_ag
            assert torch.equal(got, want), i
