"""FP8 delayed scaling (Transformer Engine's DelayedScaling on torchao's casts, megatron_zero/fp8/delayed.py).

One rank: over 4 steps of 2 micro-batches, the FP8 model's losses and every layer's final scales equal, bit for
bit, a reference written here in plain torch from Transformer Engine's algorithm: per layer and operand (input,
weight, output gradient) a cast multiplies by the current scale (1 at first), then that cast's amax joins the
operand's record and the next scale is fp8_max / (the max of the last L amaxes, or the last one) / 2^margin,
the previous scale kept for an amax of 0; a forward without autograd (evaluation) records nothing.
The history survives a checkpoint's scaling state bit-exactly (tests/test_fp8_checkpoint_cli.py does it through
pretrain_gpt.py).
TP2 with SP and TP2 x DP2 (slow): losses, gradient norms and each layer's final scales equal the
one-process delayed reference within fp8_same_scale_rtol, and fail it with the amaxes not reduced over TP
(and DP).
"""
import copy

import pytest
import torch

from megatron_zero.fp8.convert import Float8Converter
from megatron_zero.fp8.delayed import histories, load_scaling_state, scaling_state
from megatron_zero.fp8.settings import Float8Settings
from megatron_zero.model import reference_model
from megatron_zero.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron_zero.testing import run_ranks
from megatron_zero.testing.fp8_layouts import (GLOBAL_BATCH, config, delayed_settings, fp8_layout_run,
                                               reference_run)
from megatron_zero.testing.tiny_gpt import tiny_llama_config
from megatron_zero.testing.tolerances import assert_losses_close, assert_within, fp8_same_scale_rtol

pytest.importorskip("torchao.float8")
CPU = torch.device("cpu")
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
HP = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01)


def _fp8(t, scale, dtype):
    """t through FP8 and back: scaled, saturated, rounded to `dtype`, unscaled."""
    top = torch.finfo(dtype).max
    return (t.float() * scale).clamp(-top, top).to(dtype).float() / scale


class _Reference:
    """One layer's delayed scaling, written from Transformer Engine's description: every cast's amax kept."""

    def __init__(self, length, algo, margin):
        self.length, self.algo, self.margin = length, algo, margin
        self.amaxes = {op: [] for op in "xwg"}
        self.scales = {op: torch.tensor(1.0) for op in "xwg"}

    def scale(self, op, t, dtype):
        used = self.scales[op]
        self.amaxes[op].append(t.abs().max().float())
        window = self.amaxes[op][-self.length:]
        amax = torch.stack(window).max() if self.algo == "max" else window[-1]
        if amax > 0:
            self.scales[op] = torch.finfo(dtype).max / amax / 2.0 ** self.margin
        return used


class _ReferenceLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, ref):
        x2 = x.reshape(-1, x.shape[-1])
        sx, sw = ref.scale("x", x2, E4M3), ref.scale("w", w, E4M3)
        ctx.save_for_backward(x2, w)
        ctx.ref, ctx.s = ref, (sx, sw)
        return torch.mm(_fp8(x2, sx, E4M3), _fp8(w.t(), sw, E4M3)).reshape(*x.shape[:-1], w.shape[0])

    @staticmethod
    def backward(ctx, grad):
        x2, w = ctx.saved_tensors
        sx, sw = ctx.s
        g = grad.reshape(-1, grad.shape[-1])
        g8 = _fp8(g, ctx.ref.scale("g", g, E5M2), E5M2)
        grad_x = torch.mm(g8, _fp8(w.t(), sw, E4M3).t()).reshape(*grad.shape[:-1], w.shape[1])
        return grad_x, torch.mm(g8.t(), _fp8(x2, sx, E4M3)), None


def _reference_layers(model, length, algo, margin):
    """The blocks' linear layers multiplying through _ReferenceLinear; -> their states, in module order."""
    refs = []
    for name, m in model.named_modules():
        if type(m) in (ColumnParallelLinear, RowParallelLinear) and not name.endswith("lm_head"):
            ref = _Reference(length, algo, margin)
            refs.append(ref)
            if type(m) is ColumnParallelLinear:
                m._linear = lambda x, bias, m=m, ref=ref: (
                    _ReferenceLinear.apply(x, m.weight, ref) + (0 if bias is None else bias))
            else:
                m._matmul = lambda x, m=m, ref=ref: _ReferenceLinear.apply(x, m.weight, ref)
    return refs


def _train(model, steps, opt=None, first=0):
    opt = opt or torch.optim.AdamW(model.parameters(), **HP)
    losses = []
    for step in range(first, first + steps):
        tokens = torch.randint(0, 100, (2, 9), generator=torch.Generator().manual_seed(50 + step))
        opt.zero_grad()
        total = 0.0
        for j in range(2):
            loss = model(tokens[j:j + 1, :-1], labels=tokens[j:j + 1, 1:]) / 2
            loss.backward()
            total += loss.detach()
        opt.step()
        losses.append(total)
    return losses, opt


@pytest.mark.parametrize("length, algo, margin", [(3, "max", 0),
                                                  pytest.param(1, "most_recent", 1, marks=pytest.mark.slow)])
def test_one_rank_equals_transformer_engines_algorithm(length, algo, margin):
    cfg = tiny_llama_config(num_layers=2)
    torch.manual_seed(0)
    ours, theirs = reference_model(cfg), reference_model(cfg)
    theirs.load_state_dict(ours.state_dict())
    line = Float8Converter(Float8Settings("hybrid", "delayed", margin, True, length, algo), CPU)(ours)
    assert f"FP8 (hybrid, delayed scaling, amax history {length} ({algo}), emulated" in line
    refs = _reference_layers(theirs, length, algo, margin)
    got, _ = _train(ours, 4)
    want, _ = _train(theirs, 4)
    assert all(torch.equal(a, b) for a, b in zip(got, want)), (got, want)
    states = [s for _, s in histories(ours)]
    assert len(states) == len(refs) == 8
    for state, ref in zip(states, refs):
        want_scales = torch.stack([ref.scales[op] for op in "xwg"])
        assert torch.equal(state.scale, want_scales), (state.scale, want_scales)
        assert (want_scales != 1).all()  # every operand's scale moved from the start
    before = copy.deepcopy(states)
    with torch.no_grad():  # an evaluation's forward casts with the scales and leaves the histories alone
        ours(torch.randint(0, 100, (1, 8)))
    assert all(torch.equal(a.history, b.history) and torch.equal(a.scale, b.scale) for a, b in zip(states, before))


def test_scaling_state_resumes_bit_exactly():
    """Two steps, the weights, optimizer and scaling state kept, two more: the same as four straight; without
    the scaling state restored (fresh histories, scale 1) the next losses differ."""
    cfg = tiny_llama_config(num_layers=2)
    settings = delayed_settings(history=4, algo="max")
    torch.manual_seed(0)
    straight = reference_model(cfg)
    start = {k: v.clone() for k, v in straight.state_dict().items()}
    Float8Converter(settings, CPU)(straight)
    _, opt = _train(straight, 2)
    saved = copy.deepcopy((straight.state_dict(), opt.state_dict(), scaling_state(straight)))
    want, _ = _train(straight, 2, opt, first=2)
    for restore in (True, False):
        resumed = reference_model(cfg)
        resumed.load_state_dict(start)
        Float8Converter(settings, CPU)(resumed)
        resumed.load_state_dict(saved[0])
        opt = torch.optim.AdamW(resumed.parameters(), **HP)
        opt.load_state_dict(saved[1])
        if restore:
            assert load_scaling_state(resumed, saved[2]) is None
        got, _ = _train(resumed, 2, opt, first=2)
        assert all(torch.equal(a, b) for a, b in zip(got, want)) == restore, (restore, got, want)
    other = reference_model(cfg)
    Float8Converter(delayed_settings(history=2), CPU)(other)
    assert "start fresh" in load_scaling_state(other, saved[2])  # another history length: one line


def _check(run, reference):
    rtol = fp8_same_scale_rtol(config(), GLOBAL_BATCH * config().seq_length)
    ref_losses, ref_norms, ref_scales = reference
    assert_losses_close(run["losses"], ref_losses, rtol, "loss")
    assert_losses_close(run["norms"], ref_norms, rtol, "gradient norm")
    assert len(run["scales"]) == len(ref_scales)
    for got, want in zip(run["scales"], ref_scales):
        assert_within(got, want, rtol * want.abs(), "scale")


def _layout_and_broken(**layout):
    return fp8_layout_run(recipe="delayed", **layout), fp8_layout_run(recipe="delayed", broken=True, **layout)


def _assert_layout(world, dp=1, **layout):
    runs = run_ranks(_layout_and_broken, world, timeout=600, **layout)
    reference = reference_run(delayed_settings(), dp)
    for good, broken in runs:
        _check(good, reference)
        with pytest.raises(AssertionError):
            _check(broken, reference)


@pytest.mark.slow
def test_tp2_sequence_parallel_matches_one_process():
    _assert_layout(2, tp=2, sequence_parallel=True)


@pytest.mark.slow
def test_tp2_dp2_matches_one_process():
    """With DP2 every micro-batch's amaxes are reduced over DP too: one history for both replicas."""
    _assert_layout(4, dp=2, tp=2)


def _amax_all_reduces_per_step(**layout):
    """fp8_layout_run's delayed-scaling run at `layout`, counting the all-reduces the FP8 casts issue."""
    import sys

    import torch.distributed as dist

    from megatron_zero.testing.fp8_layouts import STEPS

    plain, count = dist.all_reduce, [0]

    def counted(*args, **kwargs):
        count[0] += sys._getframe(1).f_globals["__name__"].startswith("megatron_zero.fp8")
        return plain(*args, **kwargs)
    dist.all_reduce = counted
    try:
        run = fp8_layout_run(recipe="delayed", **layout)
    finally:
        dist.all_reduce = plain
    return run, count[0] / STEPS


def test_amaxes_reduced_together_once_per_group():
    """Delayed scaling reduces a step's amaxes in one all-reduce per group per reduction point (Transformer
    Engine's global amax buffer), not one per cast; the scales and losses are those of the one-process model.
    At TP2 the casts that reduce over TP are the column-parallel layers' W and g and the row-parallel layers'
    x and W: 2 per layer per micro-batch, 16 per micro-batch here."""
    runs = run_ranks(_amax_all_reduces_per_step, 2, timeout=300, tp=2)
    reference = reference_run(delayed_settings())
    micro_batches = GLOBAL_BATCH
    for run, per_step in runs:
        _check(run, reference)
        assert per_step <= 2 * micro_batches, f"{per_step} amax all-reduces a step"  # each micro-batch's forward amaxes, then its backward's


def test_a_models_waiting_amaxes_wait_for_its_own_casts():
    """Each model's casts wait in the model's own buffer (the converter's): a cast of another model of the same
    process (here a layer used alone) neither reduces nor records them, so no reduction over a model's groups
    runs at a point that its other ranks need not reach (tests/test_fp8_moe.py's
    test_expert_without_rows_joins_the_reductions[delayed] failed on that: its peer had left); its own next cast does."""
    from megatron_zero.fp8.delayed import AmaxHistory
    from megatron_zero.fp8.matmul import Float8Matmul

    config = delayed_settings().linear_config()
    layer = ColumnParallelLinear(16, 8, bias=False)  # a model of one layer, converted
    Float8Converter(delayed_settings(), CPU).convert(layer)
    alone = Float8Matmul(config, "column", delayed=AmaxHistory(1, "most_recent", 0, CPU))
    x = torch.randn(4, 16)
    layer(x)
    for _ in range(2):  # its second cast of x flushes its own buffer
        alone(x, torch.randn(8, 16))
    assert torch.equal(layer.fp8.delayed.scale, torch.ones(3)) and not torch.equal(alone.delayed.scale, torch.ones(3))
    layer(x)
    assert layer.fp8.delayed.scale[0] != 1
