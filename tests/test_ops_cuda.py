"""The fused CUDA kernels against their PyTorch references; GPU machines only."""
import warnings

import pytest
import torch

from megatron_zero import ops
from megatron_zero.ops.softmax import causal_softmax_reference
from megatron_zero.testing.tolerances import AdamWeightBound, assert_within

pytestmark = pytest.mark.gpu

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float16: dict(rtol=1e-2, atol=1e-2),
       torch.bfloat16: dict(rtol=5e-2, atol=5e-2)}


@pytest.fixture
def cuda():
    if not torch.cuda.is_available():
        reason = f"no CUDA device (torch {torch.__version__}); fused-kernel GPU tests skipped"
        warnings.warn(reason)  # shows in pytest's warnings summary without -rs
        pytest.skip(reason)
    status = ops.available_kernels()["layer_norm"]
    assert status is True, f"a CUDA device is present but megatron_zero._C_cuda is not: {status}"
    return torch.device("cuda")


def _fwd_bwd(fn, *inputs):
    xs = [x.detach().clone().requires_grad_() for x in inputs]
    out = fn(*xs)
    out.backward(torch.ones_like(out) * 0.5 + torch.arange(out.numel(), device=out.device)
                 .view_as(out).remainder(7).to(out.dtype) * 0.1)
    return [out.detach()] + [x.grad for x in xs]


def _compare(fused, ref, dtype):
    for a, b in zip(fused, ref):
        torch.testing.assert_close(a.float(), b.float(), **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_layer_norm_kernel(cuda, dtype):
    x = torch.randn(4, 33, 1027, device=cuda, dtype=dtype)
    w, b = torch.randn(1027, device=cuda, dtype=dtype), torch.randn(1027, device=cuda, dtype=dtype)
    _compare(_fwd_bwd(lambda *t: ops.layer_norm(*t, fused=True), x, w, b),
             _fwd_bwd(lambda *t: ops.layer_norm(*t, fused=False), x, w, b), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_kernel(cuda, dtype):
    x = torch.randn(4, 33, 1027, device=cuda, dtype=dtype)
    w = 1 + 0.1 * torch.randn(1027, device=cuda, dtype=dtype)
    _compare(_fwd_bwd(lambda *t: ops.rms_norm(*t, 1e-6, fused=True), x, w),
             _fwd_bwd(lambda *t: ops.rms_norm(*t, 1e-6, fused=False), x, w), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rotary_dim", [64, 32])  # the whole head, and --rotary-percent 0.5
def test_rope_kernel(cuda, dtype, rotary_dim):
    cos, sin = ops.rotary_tables(37, rotary_dim, 10000.0, cuda)
    q = torch.randn(2, 37, 6, 64, device=cuda, dtype=dtype).transpose(1, 2)  # [b, heads, s, hd], not contiguous
    _compare(_fwd_bwd(lambda t: ops.apply_rotary_pos_emb(t, cos, sin, fused=True), q),
             _fwd_bwd(lambda t: ops.apply_rotary_pos_emb(t, cos, sin, fused=False), q), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seq", [1, 37, 512])
def test_causal_softmax_kernel(cuda, dtype, seq):
    x = torch.randn(6, seq, seq, device=cuda, dtype=dtype)
    fused = _fwd_bwd(lambda t: ops.scaled_upper_triang_masked_softmax(t, 0.3, fused=True), x)
    ref = _fwd_bwd(lambda t: causal_softmax_reference(t, 0.3), x)
    _compare(fused, ref, dtype)
    assert (fused[0].triu(1) == 0).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_bias_gelu_kernel(cuda, dtype):
    y, bias = torch.randn(8, 5, 4096 + 3, device=cuda, dtype=dtype), \
        torch.randn(4096 + 3, device=cuda, dtype=dtype)
    _compare(_fwd_bwd(lambda b, t: ops.bias_gelu(b, t, fused=True), bias, y),
             _fwd_bwd(lambda b, t: ops.bias_gelu(b, t, fused=False), bias, y), dtype)


def test_multi_tensor_adamw_kernel_matches_torch(cuda):
    """100 fp32 AdamW steps, the kernel against torch.optim.AdamW on the same gradients: each step's update
    is the same expression evaluated in another order, so the weights differ by the roundings of the steps
    (AdamWeightBound with exact gradients: a few ulps of the weight and of the update per step, summed)."""
    shapes = [(1,), (7,), (1000003,), (33, 65)]
    ref = [torch.randn(s, device=cuda, requires_grad=True) for s in shapes]
    params = [p.detach().clone() for p in ref]
    m, v = [torch.zeros_like(p) for p in params], [torch.zeros_like(p) for p in params]
    opt = torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.1)
    bound = AdamWeightBound(0.0, lr=1e-2)
    for step in range(1, 101):
        grads = [torch.randn(s, device=cuda) for s in shapes]
        for r, g in zip(ref, grads):
            r.grad = g.clone()
        opt.step()
        bound.step(dict(enumerate(grads)), dict(enumerate(ref)))
        ops.multi_tensor_adamw_(params, grads, m, v, step=step, lr=1e-2, weight_decay=0.1,
                                fused=True)
    bounds = bound.bounds()
    for i, (a, b) in enumerate(zip(params, ref)):
        assert_within(a, b.detach(), bounds[i], f"tensor {shapes[i]} after 100 steps")
