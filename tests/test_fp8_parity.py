"""FP8 training (torchao's float8, emulated on the CPU) at each layout against the one-process FP8 model.

One rank: our FP8 step is torchao's own: the same model with its blocks' linear layers as nn.Linear,
converted by torchao's convert_to_float8_training, gives bit-identical loss and gradients for every recipe.
Multi-rank: every FP8 cast's scale, each step's loss and gradient norm equal the one-process FP8
reference's within fp8_same_scale_rtol (megatron_zero/testing/tolerances.py says why that bound holds),
and the same run with the amaxes not reduced over TP (or CP) fails that check: the check is what
catches a scale taken from a shard. TP2 with SP runs in the default tier; DP2 at ZeRO-1 and ZeRO-3,
PP2 (TP2 x PP2), CP2 and TP2 rowwise under `slow`.
"""
import pytest
import torch

from megatron_zero.fp8.convert import Float8Converter
from megatron_zero.fp8.settings import RECIPES, Float8Settings
from megatron_zero.model import reference_model
from megatron_zero.testing import run_ranks
from megatron_zero.testing.fp8_torchao import torchao_reference
from megatron_zero.testing.fp8_layouts import (GLOBAL_BATCH, config, expected_scales, fp8_layout_run,
                                               reference_run)
from megatron_zero.testing.tiny_gpt import tiny_llama_config
from megatron_zero.testing.tolerances import assert_losses_close, assert_within, fp8_same_scale_rtol

pytest.importorskip("torchao.float8")
CPU = torch.device("cpu")


@pytest.mark.parametrize("recipe", [r for r in RECIPES if r != "delayed"])  # delayed: test_fp8_delayed.py
def test_one_rank_step_is_torchaos(recipe):
    cfg = tiny_llama_config(num_layers=2)
    torch.manual_seed(0)
    plain = reference_model(cfg)
    ours, theirs = reference_model(cfg), reference_model(cfg)
    ours.load_state_dict(plain.state_dict())
    theirs.load_state_dict(plain.state_dict())
    settings = Float8Settings("hybrid", recipe, emulate=True)
    line = Float8Converter(settings, CPU)(ours)
    assert f"FP8 (hybrid, {recipe} scaling, emulated): 8 linear layers" in line  # QKV, projection, MLP's two
    torchao_reference(theirs, settings)
    tokens = torch.randint(0, 100, (2, 9), generator=torch.Generator().manual_seed(1))
    results = []
    for model in (plain, ours, theirs):
        loss = model(tokens[:, :-1], labels=tokens[:, 1:])
        loss.backward()
        results.append((loss.detach(), [p.grad for p in model.parameters()]))
    (plain_loss, _), (loss, grads), (want_loss, want_grads) = results
    assert torch.equal(loss, want_loss) and len(grads) == len(want_grads)
    assert all(torch.equal(g, w) for g, w in zip(grads, want_grads))
    assert loss != plain_loss  # the GEMMs did run in FP8


def _check(run, reference, dp, scales):
    """The layout's losses, norms and scales against the reference (AssertionError past the bound)."""
    rtol = fp8_same_scale_rtol(config(), GLOBAL_BATCH * config().seq_length)
    ref_losses, ref_norms, ref_scales = reference
    assert_losses_close(run["losses"], ref_losses, rtol, "loss")
    assert_losses_close(run["norms"], ref_norms, rtol, "gradient norm")
    if scales:  # in call order at PP 1 (a pipeline interleaves the micro-batches' forwards and backwards)
        want = expected_scales(ref_scales, run["dp_rank"], dp)
        assert len(run["scales"]) == len(want)
        for got, w in zip(run["scales"], want):
            if got.shape == w.shape:  # rowwise: a column-parallel shard's own rows only (checked by the loss)
                assert_within(got, w, rtol * w.abs(), "scale")


def _layout_and_broken(**layout):
    return fp8_layout_run(**layout), fp8_layout_run(broken=True, **layout)


def _assert_layout(world, dp=1, scales=True, **layout):
    runs = run_ranks(_layout_and_broken, world, timeout=600, **layout)
    reference = reference_run(Float8Settings("hybrid", layout.get("recipe", "tensorwise"), emulate=True), dp,
                              layout.get("cp", 1))
    for good, broken in runs:
        _check(good, reference, dp, scales)
        with pytest.raises(AssertionError):
            _check(broken, reference, dp, scales)


def test_tp2_sequence_parallel_matches_one_process():
    _assert_layout(2, tp=2, sequence_parallel=True)


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 3])
def test_tp2_dp2_zero_matches_one_process(stage):
    """The default tier's claim (test_tp2_sequence_parallel_matches_one_process) with DP2 at ZeRO-1/3."""
    _assert_layout(4, dp=2, tp=2, stage=stage)


@pytest.mark.slow
def test_tp2_pp2_matches_one_process():
    """The same claim with PP2 (the losses and norms; a pipeline casts in another order)."""
    _assert_layout(4, scales=False, tp=2, pp=2)


@pytest.mark.slow
def test_cp2_matches_one_process():
    """The same claim with CP2 (the tokens split: the activations' and output gradients' amaxes over CP)."""
    _assert_layout(2, cp=2)


@pytest.mark.slow
def test_tp2_rowwise_matches_one_process():
    """The same claim for the rowwise recipe."""
    _assert_layout(2, tp=2, sequence_parallel=True, recipe="rowwise")
