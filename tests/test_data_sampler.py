import pytest

from megatron_zero.data.sampler import GlobalBatchSampler

G = 16


def _global_batches(total, consumed, m, dp):
    """Reassemble what all DP ranks read into one flat list per global batch."""
    per_rank = [list(GlobalBatchSampler(total, consumed, m, G, r, dp)) for r in range(dp)]
    ga = G // (m * dp)
    n_micro = len(per_rank[0])
    assert all(len(p) == n_micro for p in per_rank) and n_micro % ga == 0
    batches = []
    for k in range(n_micro // ga):
        flat = []
        for j in range(ga):
            for r in range(dp):
                mb = per_rank[r][k * ga + j]
                assert len(mb) == m
                flat.extend(mb)
        batches.append(flat)
    return batches


def test_same_global_batches_for_any_dp_and_micro_batch():
    total = 16 * 7 + 5  # a ragged tail that must be dropped
    reference = [list(range(k * G, (k + 1) * G)) for k in range(7)]
    for dp in (1, 2, 4):
        for m in (1, 2, 4):
            assert _global_batches(total, 0, m, dp) == reference, (dp, m)


def test_megatron_micro_step_layout():
    # micro-step j covers [j*m*DP, (j+1)*m*DP); rank r takes its m consecutive indices
    s = GlobalBatchSampler(32, 0, micro_batch_size=2, global_batch_size=16, dp_rank=1, dp_size=2)
    assert list(s)[:4] == [[2, 3], [6, 7], [10, 11], [14, 15]]
    assert s.num_micro_batches == 4 and len(s) == 8


@pytest.mark.parametrize("dp,m", [(1, 1), (2, 2), (4, 1), (2, 4)])
def test_resume_from_any_consumed_count_continues_the_sequence(dp, m):
    total = 200
    full = [i for b in _global_batches(total, 0, m, dp) for i in b]
    for consumed in range(0, 97, 3):  # multiples of G and arbitrary counts alike
        resumed = [i for b in _global_batches(total, consumed, m, dp) for i in b]
        assert resumed == list(range(consumed, consumed + len(resumed)))
        overlap = min(len(resumed), len(full) - consumed)
        assert resumed[:overlap] == full[consumed:consumed + overlap]
        assert len(resumed) == (total - consumed) // G * G


def test_invalid_layout_is_refused_with_a_sentence():
    with pytest.raises(ValueError, match="multiple of"):
        GlobalBatchSampler(100, 0, micro_batch_size=3, global_batch_size=16, dp_rank=0, dp_size=2)
    with pytest.raises(ValueError, match="consumed_samples"):
        GlobalBatchSampler(100, 101, 1, 16, 0, 1)
