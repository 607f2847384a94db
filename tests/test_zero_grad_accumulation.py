"""--no-gradient-accumulation-fusion: what the flag switches (ZeRO stages 0/1, one process).

On (default): each micro-batch's gradient is added into a persistent fp32 flat buffer as backward
produces it (Megatron's fp32 main_grad). Off: `.grad` accumulates in the model dtype and is copied
out at the step. In fp32 the two are bit-identical; in bf16 the fused path is closer to the exact
(fp64) sum of the micro-batch gradients.
"""
import pytest
import torch

from megatron_zero.ops import set_fusion_flags
from megatron_zero.zero import ZeroOptimizer

MICRO = 16


def _accumulated(dtype, fusion, stage):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8)).to(dtype)
    old = set_fusion_flags(gradient_accumulation_fusion=fusion)
    try:
        opt = ZeroOptimizer(list(model.named_parameters()), stage=stage, dtype=dtype)
    finally:
        set_fusion_flags(**{"gradient_accumulation_fusion": old.gradient_accumulation_fusion})
    gen = torch.Generator().manual_seed(1)
    for _ in range(MICRO):
        x = torch.randn(4, 32, generator=gen).to(dtype)
        opt.backward(model(x).float().pow(2).mean())
    grads = [g.clone() for g in opt.impl.grad_partitions()]
    return grads, opt


def _exact_bf16_sum():
    """The fp64 sum of the per-micro-batch gradients of the bf16 model."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8)).to(torch.bfloat16)
    total = [torch.zeros(p.shape, dtype=torch.float64) for p in model.parameters()]
    gen = torch.Generator().manual_seed(1)
    for _ in range(MICRO):
        x = torch.randn(4, 32, generator=gen).to(torch.bfloat16)
        model.zero_grad()
        model(x).float().pow(2).mean().backward()
        for t, p in zip(total, model.parameters()):
            t += p.grad.double()
    return torch.cat([t.reshape(-1) for t in total])


@pytest.mark.parametrize("stage", [0, 1])
def test_fp32_accumulation_is_bit_identical_either_way(stage):
    fused, opt = _accumulated(torch.float32, True, stage)
    plain, opt_plain = _accumulated(torch.float32, False, stage)
    assert opt.impl.main_grads is not None and opt_plain.impl.main_grads is None
    assert all(torch.equal(a, b) for a, b in zip(fused, plain))


def test_bf16_accumulation_in_fp32_is_closer_to_the_exact_sum():
    exact = _exact_bf16_sum()
    fused = torch.cat(_accumulated(torch.bfloat16, True, 1)[0])[:exact.numel()].double()
    plain = torch.cat(_accumulated(torch.bfloat16, False, 1)[0])[:exact.numel()].double()
    err_fused, err_plain = (fused - exact).norm().item(), (plain - exact).norm().item()
    assert err_fused < 1e-5 * exact.norm().item(), err_fused          # fp32 sums of bf16 gradients
    assert err_plain > 10 * err_fused, (err_plain, err_fused)         # bf16 sums lose bits
