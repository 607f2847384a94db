"""The PyTorch fallbacks of megatron_zero.ops against straightforward references."""
import math
import warnings

import pytest
import torch

from megatron_zero import ops
from megatron_zero.ops import fusion_flags


def _grads(fn, *inputs):
    xs = [x.detach().clone().requires_grad_() for x in inputs]
    out = fn(*xs)
    out.backward(torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out))
    return out.detach(), [x.grad for x in xs]


def _layer_norm_by_hand(x, w, b, eps):
    mean = x.mean(-1, keepdim=True)
    var = ((x - mean) ** 2).mean(-1, keepdim=True)
    return (x - mean) / torch.sqrt(var + eps) * w + b


def test_layer_norm_fallback_values_and_gradients():
    torch.manual_seed(0)
    x, w, b = torch.randn(3, 5, 37, dtype=torch.float64), torch.randn(37, dtype=torch.float64), \
        torch.randn(37, dtype=torch.float64)
    got, got_g = _grads(lambda *t: ops.layer_norm(*t, eps=1e-5, fused=False), x, w, b)
    want, want_g = _grads(lambda *t: _layer_norm_by_hand(*t, 1e-5), x, w, b)
    torch.testing.assert_close(got, want)
    for a, e in zip(got_g, want_g):
        torch.testing.assert_close(a, e)


def _causal_softmax_by_hand(x, scale):
    rows = []
    for i in range(x.shape[1]):
        visible = torch.softmax(x[:, i, : i + 1] * scale, dim=-1)
        rows.append(torch.cat([visible, x.new_zeros(x.shape[0], x.shape[2] - i - 1)], dim=-1))
    return torch.stack(rows, dim=1)


def test_causal_softmax_fallback_values_and_gradients():
    torch.manual_seed(0)
    x = torch.randn(4, 9, 9, dtype=torch.float64)
    got, got_g = _grads(lambda t: ops.scaled_upper_triang_masked_softmax(t, 0.125, fused=False), x)
    want, want_g = _grads(lambda t: _causal_softmax_by_hand(t, 0.125), x)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(got_g[0], want_g[0])
    assert (got.triu(1) == 0).all()


def test_causal_softmax_computes_in_fp32_and_rejects_non_square():
    x = torch.randn(2, 6, 6).to(torch.bfloat16)
    y = ops.scaled_upper_triang_masked_softmax(x, 0.5, fused=False)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y, _causal_softmax_by_hand(x.float(), 0.5).to(torch.bfloat16))
    with pytest.raises(ValueError, match=r"\[batches, sq, sq\]"):
        ops.scaled_upper_triang_masked_softmax(torch.randn(2, 3, 4))


def _megatron_bias_gelu(bias, y):
    x = bias + y
    return x * 0.5 * (1.0 + torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x)))


def _megatron_bias_gelu_grad(dout, bias, y):
    x = bias + y
    tanh_out = torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x))
    ff = 0.5 * x * ((1 - tanh_out * tanh_out) * (0.79788456 + 0.1070322243 * x * x)) \
        + 0.5 * (1 + tanh_out)
    return ff * dout


def test_bias_gelu_fallback_matches_megatron_formula_and_its_derivative():
    torch.manual_seed(0)
    y, bias = torch.randn(6, 4, 32, dtype=torch.float64), torch.randn(32, dtype=torch.float64)
    got, (dbias, dy) = _grads(lambda b, t: ops.bias_gelu(b, t, fused=False), bias, y)
    torch.testing.assert_close(got, _megatron_bias_gelu(bias, y), rtol=1e-7, atol=1e-7)
    dout = torch.linspace(-1, 1, got.numel(), dtype=got.dtype).view_as(got)
    want_dy = _megatron_bias_gelu_grad(dout, bias, y)
    # Megatron's constants are rounded to 8-10 digits, hence the tolerance.
    torch.testing.assert_close(dy, want_dy, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(dbias, want_dy.sum((0, 1)), rtol=1e-6, atol=1e-6)


def test_multi_tensor_adam_fallback_matches_torch_adamw():
    torch.manual_seed(0)
    shapes = [(3, 4), (7,), (1,)]
    ref = [torch.randn(s, requires_grad=True) for s in shapes]
    params = [p.detach().clone() for p in ref]
    m = [torch.zeros_like(p) for p in params]
    v = [torch.zeros_like(p) for p in params]
    opt = torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.1)
    for step in range(1, 6):
        grads = [torch.randn(s) for s in shapes]
        for r, g in zip(ref, grads):
            r.grad = g.clone()
        opt.step()
        ops.multi_tensor_adamw_(params, grads, m, v, step=step, lr=1e-2, weight_decay=0.1,
                                fused=False)
    for a, b in zip(params, ref):
        torch.testing.assert_close(a, b.detach(), rtol=1e-6, atol=1e-7)
    with pytest.raises(ValueError, match="equal lengths"):
        ops.multi_tensor_adamw_(params, grads[:1], m, v, step=1, lr=1e-2)


def test_fusion_flags_switch_and_override():
    old = ops.set_fusion_flags(bias_gelu_fusion=False)
    try:
        assert ops.get_fusion_flags().bias_gelu_fusion is False
        assert fusion_flags.use_fused("bias_gelu_fusion", None) is False
        assert fusion_flags.use_fused("bias_gelu_fusion", True) is True
        assert ops.get_fusion_flags().masked_softmax_fusion is True
    finally:
        ops.set_fusion_flags(**vars(old))
    assert ops.get_fusion_flags() == old
    with pytest.raises(ValueError, match="unknown fusion flag"):
        ops.set_fusion_flags(no_such_fusion=True)


def test_cpu_tensors_without_a_cpu_kernel_use_fallback_even_when_fusion_is_on():
    x = torch.randn(2, 5, 5, dtype=torch.float64)  # the CPU kernels are fp32 only
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        y = ops.scaled_upper_triang_masked_softmax(x, 1.0, fused=True)
    assert y.grad_fn is None or "Fused" not in type(y.grad_fn).__name__
    assert math.isclose(y[0, 2].sum().item(), 1.0, rel_tol=1e-6)


def test_available_kernels_reports_every_kernel():
    report = ops.available_kernels()
    assert set(report) == {"cpu_adam", "layer_norm", "scaled_upper_triang_masked_softmax",
                           "bias_gelu", "multi_tensor_adam", "rms_norm", "rope",
                           "cpu_bias_gelu", "cpu_scaled_upper_triang_masked_softmax", "cpu_rms_norm",
                           "cpu_cross_entropy_exp"}
    for name, status in report.items():
        assert status is True or (isinstance(status, str) and status), name
    if not torch.cuda.is_available():
        assert report["layer_norm"] is not True
