"""The derived fp32 tolerances (megatron_zero/testing/tolerances.py) admit another summation order and
refuse real bugs. On the toy GPT, 10 AdamW steps whose gradient is the mean of two half-batch gradients
(DP 2's order) stay within the per-step loss tolerance and the Adam-aware weight bound of the
single-batch reference; the same run with one half's gradient missing (no all-reduce), or with the
learning rate 2 % off, or without clipping, leaves the weight bound."""
import pytest
import torch

from megatron_zero.testing.toy_zero import HP, ToyGPT, batch, reference, toy_path_length
from megatron_zero.testing.tolerances import (EPS32, adam_bound_of_update, assert_losses_close, assert_within,
                                              model_rtol, reduction_atol)

pytestmark = pytest.mark.isa

STEPS, CLIP = 10, 0.3


def halves_run(halves=(0, 1), lr_scale=1.0, clip=CLIP):
    model = ToyGPT(2)
    opt = torch.optim.AdamW(model.parameters(), **{**HP, "lr": HP["lr"] * lr_scale})
    losses = []
    for s in range(STEPS):
        tokens, labels = batch(s)
        total = 0.0
        for h in halves:  # each half's mean loss, averaged over the two: the full batch's mean
            loss = model(tokens[4 * h:4 * h + 4], labels[4 * h:4 * h + 4]) / 2
            loss.backward()
            total += loss.item()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses, {n: p.detach() for n, p in model.named_parameters()}


@pytest.fixture(scope="module")
def ref():
    return reference(steps=STEPS, clip=CLIP, with_bounds=True)


def test_another_order_passes(ref):
    ref_losses, ref_weights, bounds = ref
    losses, weights = halves_run()
    assert_losses_close(losses, ref_losses, model_rtol(toy_path_length()), "loss")
    assert any(not torch.equal(w, ref_weights[n]) for n, w in weights.items())  # the order did change
    for name, w in weights.items():
        assert_within(w, ref_weights[name], bounds[name], name)


@pytest.mark.parametrize("bug", [dict(halves=(0,)), dict(lr_scale=1.02), dict(clip=0.0)],
                         ids=["missing-all-reduce", "lr-2%-off", "no-clipping"])
def test_real_bugs_leave_the_weight_bound(ref, bug):
    _, ref_weights, bounds = ref
    _, weights = halves_run(**bug)
    worst = max(float(((w - ref_weights[n]).abs() / bounds[n]).max()) for n, w in weights.items())
    assert worst > 1, worst
    failed = sum(not bool(((w - ref_weights[n]).abs() <= bounds[n]).all()) for n, w in weights.items())
    assert failed >= len(weights) // 2, (failed, len(weights))  # most tensors, not one stray element


def test_bounds_in_closed_form():
    assert adam_bound_of_update(1, (0.9, 0.95)) == pytest.approx(1.0)  # step 1: u = g / |g|
    assert 1 < adam_bound_of_update(20, (0.9, 0.95)) < 1.1
    assert reduction_atol(10, 2.0) == pytest.approx(10 * EPS32 * 2.0, rel=1e-5)
    assert model_rtol(10_000) == pytest.approx(2 ** 0.5 * 4 * 100 * EPS32 / 2)
