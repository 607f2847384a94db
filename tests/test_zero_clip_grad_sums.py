"""zero/clip_grad.local_sums: the sum of squares over counted fragments, the non-finite test, the votes."""
import math

import pytest
import torch

from megatron_zero.distributed.device import HOST
from megatron_zero.zero import clip_grad
from megatron_zero.zero.clip_grad import local_sums, norm_and_overflow


def test_sum_of_squares_is_fp64_over_counted_fragments_only():
    torch.manual_seed(0)
    a, b = torch.randn(1000), torch.randn(300)
    sums = local_sums([a, b], [[(0, 1000)], [(100, 50)]], HOST)
    want = a.double().pow(2).sum() + b[100:150].double().pow(2).sum()
    assert sums.dtype == torch.float64
    torch.testing.assert_close(sums[0], want, rtol=1e-14, atol=0)  # fp64 accumulation, another order
    assert sums[1] == 0
    norm, overflow, votes = norm_and_overflow(sums)
    assert math.isclose(norm, math.sqrt(want.item()), rel_tol=1e-14) and not overflow and votes == []


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("where", [5, 250])  # inside the counted fragment, and outside it
def test_a_non_finite_element_anywhere_is_an_overflow(bad, where):
    g = torch.randn(300)
    g[where] = bad
    _, overflow, _ = norm_and_overflow(local_sums([g], [[(0, 100)]], HOST))
    assert overflow


def test_large_finite_values_outside_the_counted_part_are_no_overflow():
    g = torch.full((300,), 3e38)  # their fp32 sum would overflow; the fp64 one does not
    _, overflow, _ = norm_and_overflow(local_sums([g], [[(0, 0)]], HOST))
    assert not overflow


def test_the_per_tensor_fallback_gives_the_same_sums(monkeypatch):
    """Without torch._foreach_norm (a private API) each fragment gets torch.linalg.vector_norm: same sums."""
    torch.manual_seed(1)
    grads = [torch.randn(1000), torch.randn(300), torch.randn(7)]
    counted = [[(0, 400), (600, 400)], [(100, 50)], []]
    fused = local_sums(grads, counted, HOST, votes=(1.0, 0.0))
    monkeypatch.delattr(torch, "_foreach_norm", raising=False)
    fallback = local_sums(grads, counted, HOST, votes=(1.0, 0.0))
    torch.testing.assert_close(fused, fallback, rtol=1e-14, atol=0)
    assert fused[2:].tolist() == [1.0, 0.0]  # the votes ride after the two sums
    assert clip_grad.norms_fp64([]) == []
