"""DeepSeek-V3's router as users train it (sigmoid scores, the aux-loss-free expert bias, group-limited routing,
a top-k scaling factor; megatron_zero/testing/expert_bias_runs.py), all slow (the default tier's cover:
tests/test_moe_expert_bias.py). EP2 x DP2 against the one-process run in-process, the losses to roundoff
(model_rtol of a step's path) and the expert biases bit for bit (the same tokens per expert summed over the
ranks, the same sign steps); the bias moves the choices (the losses differ from the unbiased run's); through
pretrain_gpt.py at TP2 (sequence parallel) x EP2, PP2 x EP2, CP2 x EP2 and ZeRO-3 x EP2 the same; a checkpoint
saved at EP2 resumed as saved, directly at EP1, EP4, TP2, PP2 and ZeRO-3 and from tools/ds_to_universal.py, the
biases restored bit for bit (the resumed run ends with the uninterrupted run's) and the losses continuing."""
import os

import pytest
import torch

from megatron_zero.model.config import GPTConfig
from megatron_zero.testing import run_ranks
from megatron_zero.testing.cli import CliResume, cli_flags, logged_losses, pretrain_cli, text_data, tool
from megatron_zero.testing.expert_bias_runs import DEEPSEEK_ROUTER, saved_expert_biases, train_with_biases
from megatron_zero.testing.tolerances import gpt_path_length, model_rtol

pytestmark = pytest.mark.multirank

ITERS = 3
# TINY of megatron_zero/testing/cli.py: one step's path bounds the roundoff of another layout's sums
RTOL = model_rtol(gpt_path_length(GPTConfig(vocab_size=257, hidden_size=32, num_layers=2, num_attention_heads=4,
                                            seq_length=16, max_position_embeddings=16), 8 * 16))


def _flags(tmp_path, *changes):
    data = text_data(tmp_path / "text")
    return cli_flags(data, str(tmp_path / "cache"), "gpt2", DEEPSEEK_ROUTER, {"train-iters": ITERS}, *changes)


def _assert_close(got, want, what):
    assert len(got) == len(want), (what, got, want)
    for g, w in zip(got, want):
        assert abs(g - w) <= RTOL * abs(w), (what, got, want, RTOL)


@pytest.mark.slow  # the default tier: test_moe_expert_bias.py's router against Megatron-Core and its update over 2 ranks
def test_expert_parallel_matches_one_process(tmp_path):
    """EP2 x DP2 ZeRO-1 (each rank half the experts and half the micro-batches) against one process."""
    (ref_losses, ref_bias), = run_ranks(train_with_biases, 1, _flags(tmp_path), timeout=600)
    runs = run_ranks(train_with_biases, 2, _flags(tmp_path, {"expert-model-parallel-size": 2}), timeout=600)
    assert any(float(b.abs().max()) > 0 for b in ref_bias.values()) and len(ref_bias) == 2
    for losses, bias in runs:
        _assert_close(losses, ref_losses, "EP2 x DP2 loss")
        assert bias.keys() == ref_bias.keys() and all(torch.equal(bias[n], ref_bias[n]) for n in bias)


@pytest.mark.slow  # the default tier: test_moe_expert_bias.py's router (a bias changes the chosen experts)
def test_the_bias_moves_the_choices(tmp_path):
    """The same run at rate 0 (the bias stays zero): the first step's loss the same, a later one not."""
    (biased, _), = run_ranks(train_with_biases, 1, _flags(tmp_path), timeout=600)
    (plain, bias), = run_ranks(train_with_biases, 1, _flags(tmp_path, {"moe-router-bias-update-rate": 0.0}),
                               timeout=600)
    assert all(float(b.abs().max()) == 0 for b in bias.values())
    assert plain[0] == biased[0] and plain[-1] != biased[-1]


@pytest.mark.slow  # the default tier: test_moe_expert_bias.py's router and its update summed over 2 ranks
@pytest.mark.parametrize("layout,nproc", [
    ({"tensor-model-parallel-size": 2, "sequence-parallel": True, "expert-model-parallel-size": 2}, 4),
    ({"pipeline-model-parallel-size": 2, "expert-model-parallel-size": 2}, 4),
    ({"context-parallel-size": 2, "expert-model-parallel-size": 2}, 4),
    ({"zero-stage": 3, "expert-model-parallel-size": 2}, 2),
], ids=["tp2-sp-ep2", "pp2-ep2", "cp2-ep2", "zero3-ep2"])
def test_pretrain_gpt_layouts_match_one_process(tmp_path, layout, nproc):
    """Through pretrain_gpt.py: the logged losses and the saved biases against the one-process run."""
    ref = pretrain_cli(1, _flags(tmp_path, {"save": tmp_path / "ref", "save-interval": ITERS}))
    run = pretrain_cli(nproc, _flags(tmp_path, layout, {"save": tmp_path / "run", "save-interval": ITERS}))
    want, got = logged_losses(ref), logged_losses(run)
    _assert_close([got[i] for i in sorted(got)], [want[i] for i in sorted(want)], str(layout))
    ref_bias = saved_expert_biases(os.path.join(tmp_path, "ref", f"global_step{ITERS}"))
    bias = saved_expert_biases(os.path.join(tmp_path, "run", f"global_step{ITERS}"))
    assert len(ref_bias) == 2 and bias.keys() == ref_bias.keys()
    assert all(torch.equal(bias[n], ref_bias[n]) for n in bias), (bias, ref_bias)


@pytest.fixture(scope="module")
def saved_at_ep2(tmp_path_factory):
    root = tmp_path_factory.mktemp("expert_bias_resume")
    data = text_data(root / "text")
    cache = str(root / "cache")
    run = CliResume(str(root), lambda *changes: cli_flags(data, cache, "gpt2", DEEPSEEK_ROUTER, *changes),
                    {"expert-model-parallel-size": 2, "zero-stage": 1}, nproc=2, iters=4, save_at=2)
    return run


@pytest.mark.slow  # the default tier: test_moe_expert_bias.py's update over 2 ranks (no checkpoint in it)
@pytest.mark.parametrize("how,layout,nproc", [
    ("as saved", {}, 2),
    ("reshaped", {"expert-model-parallel-size": 1}, 2),
    ("reshaped", {"expert-model-parallel-size": 4}, 4),
    ("reshaped", {"zero-stage": 3}, 2),
    ("reshaped", {"tensor-model-parallel-size": 2, "expert-model-parallel-size": 1}, 2),
    ("reshaped", {"pipeline-model-parallel-size": 2, "expert-model-parallel-size": 1}, 2),
    ("universal", {"expert-model-parallel-size": 1}, 1),
], ids=["as-saved", "ep1", "ep4", "zero3", "tp2", "pp2", "universal-ep1"])
def test_resume_restores_the_bias(saved_at_ep2, tmp_path, how, layout, nproc):
    run = saved_at_ep2
    saved = saved_expert_biases(run.checkpoint)
    assert len(saved) == 2 and any(float(b.abs().max()) > 0 for b in saved.values())
    out = tmp_path / "resumed"
    load = {"load": run.universal, "universal-checkpoint": True} if how == "universal" else {"load": run.checkpoint}
    resumed = pretrain_cli(nproc, run.flags({"train-iters": run.iters}, run.layout, load, layout,
                                            {"save": out, "save-interval": run.iters}))
    run.assert_matches(logged_losses(resumed), 0.0 if how == "as saved" else RTOL)
    final = saved_expert_biases(os.path.join(run.save, f"global_step{run.iters}"))
    ended = saved_expert_biases(os.path.join(out, f"global_step{run.iters}"))
    assert ended.keys() == final.keys() and all(torch.equal(ended[n], final[n]) for n in final), (ended, final)


@pytest.mark.slow  # the default tier: test_moe_expert_bias.py's checkpoint buffers test
def test_consolidation_and_generation_carry_the_bias(saved_at_ep2, tmp_path):
    """tools/zero_to_fp32.py writes each expert bias beside the weights (as DeepSpeed's does with buffers), the
    bytes as saved; tools/generate_text.py loads the checkpoint with it and generates."""
    run = saved_at_ep2
    saved = saved_expert_biases(run.checkpoint)
    tool("zero_to_fp32.py", run.checkpoint, tmp_path / "fp32", "--quiet")
    consolidated = torch.load(tmp_path / "fp32" / "pytorch_model.bin", weights_only=True)
    assert all(torch.equal(consolidated[n], saved[n]) for n in saved) and len(saved) == 2
    out = tool("generate_text.py", "--load", run.checkpoint, "--prompt", "def ", "--max-new-tokens", 4, "--greedy")
    assert out.stdout.strip(), out.stderr[-2000:]
