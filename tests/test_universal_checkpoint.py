"""Universal checkpoints: a TP2xPP2xDP2 ZeRO-1 run saved at iteration 10, converted, resumed elsewhere.

fp32, dropout 0, global batch 8 fixed. The baseline trains 20 iterations; each resume
trains iterations 10..19 on another layout / ZeRO stage / micro-batch size and must give
the baseline's loss at every iteration (relative 1e-5) and its final weights (1e-5).
"""
import os

import pytest
import torch

from megatron_zero.checkpoint.reshape.universal_convert import convert_to_universal
from megatron_zero.testing import run_ranks
from megatron_zero.testing.layout_train import ITERS, SAVE_AT, check_resume, full_weights, train


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    root = tmp_path_factory.mktemp("universal")
    results = run_ranks(train, 8, 2, 2, 1, 2, str(root), timeout=300)
    losses = results[0][1]
    assert all(r[1] == losses for r in results)
    assert losses[ITERS - 1] < losses[0] - 0.1, "the baseline must actually learn for the test to mean anything"
    src = os.path.join(root, f"global_step{SAVE_AT}")
    out = os.path.join(root, f"global_step{SAVE_AT}_universal")
    summary = convert_to_universal(src, out, merge_workers=2, extract_workers=2, progress=False)
    assert summary["layout"] == "TP=2 x PP=2 x DP=2" and summary["mismatched"] == []
    return {"losses": losses, "weights": full_weights(results), "src": src, "universal": out, "root": str(root)}


def test_universal_files(baseline):
    from megatron_zero.checkpoint.storage.tensor_io import load_file as load_any
    zero = os.path.join(baseline["universal"], "zero")
    we = load_any(os.path.join(zero, "tied_modules.embed.word_embeddings.weight", "fp32.pt"))
    assert we["param"].shape == (100, 32) and we["vocab_tensor"] is True and we["cat_dim"] == 0
    torch.testing.assert_close(we["param"], baseline_weight_at_save(baseline, "tied_modules.embed.word_embeddings.weight"))
    assert load_any(os.path.join(zero, "2.self_attention.dense.weight", "exp_avg.pt"))["cat_dim"] == 1
    assert load_any(os.path.join(zero, "3.mlp.dense_h_to_4h.weight", "fp32.pt"))["param"].shape == (128, 32)
    assert "cat_dim" not in load_any(os.path.join(zero, "6.weight", "fp32.pt"))  # final norm: TP-replicated
    assert int(load_any(os.path.join(zero, "2.input_layernorm.bias", "step.pt"))) == SAVE_AT
    assert open(os.path.join(baseline["root"], "latest_universal")).read() == f"global_step{SAVE_AT}_universal"
    assert sorted(f for f in os.listdir(baseline["universal"]) if f.startswith("mp_rank")) == \
        [f"mp_rank_{i:02d}_model_states.pt" for i in range(4)]


def baseline_weight_at_save(baseline, name):
    """The word embedding at iteration 10, rebuilt from the universal file's source: the plain checkpoint."""
    from megatron_zero.checkpoint.reshape.universal_source import SourceCheckpoint
    src = SourceCheckpoint(baseline["src"])
    with src.stage(0) as reader:
        return reader.assemble(name, "fp32")[0].clone()


@pytest.mark.parametrize("tp,pp,dp,stage,mb", [
    (2, 2, 2, 1, 2),   # (a) same layout
    # (b) slow: TP and PP merged to 1 is covered by test_universal_detected_from_parent (TP1 x DP2) and
    # tests/test_universal_llama.py's tp1-dp8-universal
    pytest.param(1, 1, 4, 1, 2, marks=pytest.mark.slow),
    (4, 1, 2, 1, 2),   # (c)
    (1, 4, 2, 1, 2),   # (d)
    (2, 1, 1, 1, 1),   # (e) 4x the gradient accumulation (8 micro-batches instead of 2)
    # (f) ZeRO-2, slow: ZeRO-1 and 2 share the flat partition (zero/stage12.py) that (a)-(e) load into
    pytest.param(2, 1, 2, 2, 2, marks=pytest.mark.slow),
    (2, 1, 2, 3, 2),   # (f) ZeRO-3
], ids=["a-same", "b-tp1pp1dp4", "c-tp4dp2", "d-pp4dp2", "e-tp2dp1-ga8", "f-zero2", "f-zero3"])
def test_universal_resume(baseline, tp, pp, dp, stage, mb):
    results = run_ranks(train, tp * pp * dp, tp, pp, stage, mb, None, baseline["universal"], timeout=300)
    check_resume(baseline, results)


def test_universal_detected_from_parent(baseline):
    """The parent directory names the universal checkpoint through latest_universal."""
    results = run_ranks(train, 2, 1, 1, 1, 4, None, baseline["root"], timeout=300)
    check_resume(baseline, results)


def test_direct_reshaped_resume(baseline):
    """--load of the plain ZeRO checkpoint at TP1 x PP2 x DP2, no conversion."""
    results = run_ranks(train, 4, 1, 2, 1, 2, None, baseline["src"], "reshaped", timeout=300)
    check_resume(baseline, results)
