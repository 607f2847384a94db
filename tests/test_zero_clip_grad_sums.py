"""zero/clip_grad.local_sums: the sum of squares over counted fragments and the non-finite test."""
import math

import pytest
import torch

from megatron_zero.zero.clip_grad import local_sums, norm_and_overflow


def test_sum_of_squares_is_fp64_over_counted_fragments_only():
    torch.manual_seed(0)
    a, b = torch.randn(1000), torch.randn(300)
    sums = local_sums([a, b], [[(0, 1000)], [(100, 50)]])
    want = a.double().pow(2).sum() + b[100:150].double().pow(2).sum()
    assert sums.dtype == torch.float64
    torch.testing.assert_close(sums[0], want, rtol=1e-14, atol=0)  # fp64 accumulation, another order
    assert sums[1] == 0
    norm, overflow = norm_and_overflow(sums)
    assert math.isclose(norm, math.sqrt(want.item()), rel_tol=1e-14) and not overflow


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("where", [5, 250])  # inside the counted fragment, and outside it
def test_a_non_finite_element_anywhere_is_an_overflow(bad, where):
    g = torch.randn(300)
    g[where] = bad
    _, overflow = norm_and_overflow(local_sums([g], [[(0, 100)]]))
    assert overflow


def test_large_finite_values_outside_the_counted_part_are_no_overflow():
    g = torch.full((300,), 3e38)  # their fp32 sum would overflow; the fp64 one does not
    _, overflow = norm_and_overflow(local_sums([g], [[(0, 0)]]))
    assert not overflow
