"""The fused fp32 CPU kernels (megatron_zero._C_cpu_ops) against their PyTorch fallbacks.

Tolerances: fp32, rtol 1e-5 with atol 1e-6 on values and 1e-5 on gradients (the kernels' exp
is within 2 ulp of expf, sums run in another order, and a bias gradient sums rows that cancel);
the RMSNorm weight gradient is bit-identical for any thread count.
"""
import dataclasses
import sys

import pytest
import torch

from megatron_zero import ops
from megatron_zero.model.attention_core import attention_core
from megatron_zero.ops import registry

pytestmark = pytest.mark.skipif(registry.load(registry.CPU_OPS_EXT) is None,
                                reason="megatron_zero._C_cpu_ops is not built")
TOL = dict(rtol=1e-5, atol=1e-6)
GRAD_TOL = dict(rtol=1e-5, atol=1e-5)


def _run(fn, inputs, fused):
    xs = [x.detach().clone().requires_grad_() for x in inputs]
    out = fn(*xs, fused=fused)
    out.backward(torch.linspace(-1, 1, out.numel()).view_as(out))
    return out, [x.grad for x in xs]


def _check(fn, inputs, kernel_node):
    got, got_g = _run(fn, inputs, fused=True)
    assert type(got.grad_fn).__name__ == kernel_node  # the kernel ran, not the fallback
    want, want_g = _run(fn, inputs, fused=False)
    assert "Fused" not in type(want.grad_fn).__name__
    torch.testing.assert_close(got, want, **TOL)
    for a, e in zip(got_g, want_g):
        torch.testing.assert_close(a, e, **GRAD_TOL)


@pytest.mark.parametrize("shape", [(3, 5, 37), (1, 1), (7, 1024)])
def test_bias_gelu_matches_fallback(shape):
    torch.manual_seed(0)
    y = torch.randn(*shape) * 4
    y.view(-1)[:2] = torch.tensor([60.0, -60.0])[: y.numel()]  # saturated tanh on both sides
    _check(lambda y, b, fused: ops.bias_gelu(b, y, fused=fused), [y, torch.randn(shape[-1])],
           "_FusedBiasGeluBackward")


@pytest.mark.parametrize("batches,s,scale", [(3, 1, 1.0), (2, 37, 0.125), (4, 128, 1 / 32 ** 0.5)])
def test_causal_softmax_matches_fallback(batches, s, scale):
    torch.manual_seed(1)
    x = torch.randn(batches, s, s) * 30  # rows with one dominant score and exps far below 1e-30
    _check(lambda x, fused: ops.scaled_upper_triang_masked_softmax(x, scale, fused=fused), [x],
           "_FusedCausalSoftmaxBackward")
    y = ops.scaled_upper_triang_masked_softmax(x, scale, fused=True)
    assert torch.equal(y.triu(1), torch.zeros_like(y))  # masked keys are exactly 0


@pytest.mark.parametrize("shape", [(4, 3, 37), (1, 256), (300, 64)])
def test_rms_norm_matches_fallback(shape):
    torch.manual_seed(2)
    _check(lambda x, w, fused: ops.rms_norm(x, w, 1e-5, fused=fused), [torch.randn(*shape) * 3,
                                                                        torch.randn(shape[-1])],
           "_FusedRMSNormBackward")


def test_rms_norm_weight_grad_is_the_same_for_any_thread_count():
    torch.manual_seed(3)
    x, w, dy = torch.randn(1000, 96), torch.randn(96), torch.randn(1000, 96)
    threads, grads = torch.get_num_threads(), []
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            ww = w.clone().requires_grad_()
            ops.rms_norm(x, ww, 1e-5, fused=True).backward(dy)
            grads.append(ww.grad)
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(grads[0], g) for g in grads[1:])


def test_fused_attention_backend_on_cpu_matches_flash():
    torch.manual_seed(4)
    q, k, v = (torch.randn(2, 4, 48, 16, requires_grad=True) for _ in range(3))
    fused = attention_core(q, k, v, "fused", 0.0, True)
    flash = attention_core(q, k, v, "flash", 0.0, True)
    torch.testing.assert_close(fused, flash, **TOL)
    g = torch.randn_like(fused)
    got = torch.autograd.grad(fused, (q, k, v), g)
    want = torch.autograd.grad(flash, (q, k, v), g)
    for a, e in zip(got, want):
        torch.testing.assert_close(a, e, **GRAD_TOL)


def test_other_dtypes_fall_back_silently():
    x = torch.randn(4, 8, dtype=torch.bfloat16)
    y = ops.rms_norm(x, torch.ones(8, dtype=torch.bfloat16), 1e-5)
    assert y.grad_fn is None or "Fused" not in type(y.grad_fn).__name__


def test_not_built_warns_once_and_falls_back(monkeypatch):
    monkeypatch.setitem(sys.modules, registry.CPU_OPS_EXT, None)  # as after a build without a compiler
    monkeypatch.delitem(registry._loaded, registry.CPU_OPS_EXT, raising=False)
    monkeypatch.setattr(registry, "_warned", set())
    x, b = torch.randn(4, 8, requires_grad=True), torch.randn(8)
    with pytest.warns(UserWarning, match="bias_gelu uses the PyTorch fallback: megatron_zero._C_cpu_ops is not built"):
        y = ops.bias_gelu(b, x)
    assert "Fused" not in type(y.grad_fn).__name__
    assert "cpu_rms_norm, cpu_cross_entropy_exp: not built" in ops.kernel_report()
    monkeypatch.delitem(registry._loaded, registry.CPU_OPS_EXT)  # the next test loads the real module


def test_cross_entropy_exponentials_match_fallback():
    from megatron_zero.ops.exp_rows import exp_shifted_rows
    torch.manual_seed(5)
    x = torch.randn(3, 5, 300) * 20
    x[..., 290:] = float("-inf")  # vocabulary padding
    x[0, 0, 7] = 150.0  # a row whose other exponentials underflow
    shift = x.amax(dim=-1)
    e, sums = exp_shifted_rows(x, shift)
    want_e, want_sums = exp_shifted_rows(x, shift, fused=False)
    torch.testing.assert_close(e, want_e, **TOL)
    torch.testing.assert_close(sums, want_sums, **TOL)
    assert torch.count_nonzero(e[..., 290:]) == 0
    x[1, 2, 3] = float("nan")
    e, sums = exp_shifted_rows(x, x.amax(dim=-1))
    assert torch.isnan(sums[1, 2]) and torch.isfinite(sums[0]).all()  # a NaN logit is not hidden


@pytest.mark.parametrize("s,block", [(64, 16), (50, 16), (7, 64)])  # whole blocks, a short last block, one block
def test_query_blocked_attention_matches_flash(s, block, monkeypatch):
    from megatron_zero.model import attention_core as core
    monkeypatch.setattr(core, "QUERY_BLOCK", block)
    torch.manual_seed(6)
    q, k, v = (torch.randn(2, 3, s, 8, requires_grad=True) for _ in range(3))
    for backend in ("fused", "auto"):
        out = core.attention_core(q, k, v, backend, 0.0, True)
        assert type(out.grad_fn).__name__ == "_BlockCausalAttentionBackward"
        flash = core.attention_core(q, k, v, "flash", 0.0, True)
        torch.testing.assert_close(out, flash, **TOL)
        g = torch.randn_like(out)
        for a, e in zip(torch.autograd.grad(out, (q, k, v), g), torch.autograd.grad(flash, (q, k, v), g)):
            torch.testing.assert_close(a, e, **GRAD_TOL)


def test_auto_uses_flash_for_long_sequences_and_without_the_fusion(monkeypatch):
    from megatron_zero.model import attention_core as core
    monkeypatch.setattr(core, "BLOCKED_MAX_SEQ", 16)

    def blocked(s):
        q = torch.randn(1, 2, s, 8, requires_grad=True)
        return "Block" in type(core.attention_core(q, q, q, "auto", 0.0, True).grad_fn).__name__

    assert blocked(16) and not blocked(17)
    old = ops.set_fusion_flags(masked_softmax_fusion=False)
    try:
        assert not blocked(16)
    finally:
        ops.set_fusion_flags(**dataclasses.asdict(old))
