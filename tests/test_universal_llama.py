"""Universal checkpoints of a Llama-style model (RMSNorm, RoPE, SwiGLU, 2 query groups, untied, no bias):
a TP2xPP2xDP2 ZeRO-1 run saved at iteration 3 resumes at TP1 (DP8), TP4 (groups < TP), PP4, DP4 and
ZeRO-3, both through tools/ds_to_universal.py's conversion and through a direct reshaped load, with
the loss at every iteration within relative 1e-5 of the uninterrupted run and the final weights
within 1e-5. The default run resumes five of the ten (DEFAULT below) in one 8-rank run; the other five,
marked `slow`, share another.
"""
import os

import pytest
import torch
import torch.distributed as dist

from megatron_zero.checkpoint.reshape.universal_convert import convert_to_universal
from megatron_zero.checkpoint.storage.tensor_io import load_file as load_any
from megatron_zero.checkpoint.export.standalone_zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
from megatron_zero.testing import run_ranks
from megatron_zero.testing.tiny_gpt import tiny_llama_config
from megatron_zero.testing.layout_train import full_weights, train

ITERS, SAVE_AT, WORLD = 5, 3, 8
# (tp, pp, zero stage); DP = 8 / (tp * pp); micro-batch 1
RESUMES = [(1, 1, 1), (4, 1, 1), (1, 4, 1), (2, 1, 1), (2, 1, 3)]
KINDS = ("universal", "reshaped")
# (kind, tp, pp, stage) resumed in the default run; the other five are `slow`, each covered here by the same
# layout on the other kind or the same kind on a like change: both kinds split TP to 4 (groups < TP),
# universal also merges to TP1 and resumes ZeRO-3 at TP2 x DP4, reshaped also moves PP2 to PP4
DEFAULT = {("universal", 1, 1, 1), ("universal", 4, 1, 1), ("universal", 2, 1, 3), ("reshaped", 4, 1, 1),
           ("reshaped", 1, 4, 1)}
CASES = [(kind, *layout) for kind in KINDS for layout in RESUMES]


def config():
    return tiny_llama_config(num_layers=4, num_query_groups=2)


def baseline_run(save_dir):
    return train(2, 2, 1, 1, save_dir, iters=ITERS, save_at=SAVE_AT, cfg=config())


def resume_everywhere(sources, cases):
    out = {}
    for kind, tp, pp, stage in cases:
        out[(kind, tp, pp, stage)] = train(tp, pp, stage, 1, None, sources[kind], kind, iters=ITERS, cfg=config())
    dist.barrier()
    return out


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    root = tmp_path_factory.mktemp("universal_llama")
    results = run_ranks(baseline_run, WORLD, str(root), timeout=300)
    losses = results[0][1]
    assert all(r[1] == losses for r in results)
    src = os.path.join(root, f"global_step{SAVE_AT}")
    out = os.path.join(root, f"global_step{SAVE_AT}_universal")
    summary = convert_to_universal(src, out, merge_workers=1, progress=False)
    assert summary["layout"] == "TP=2 x PP=2 x DP=2" and summary["mismatched"] == []
    return {"losses": losses, "weights": full_weights(results, config()), "src": src, "universal": out}


def resume_cases(baseline, cases):
    return run_ranks(resume_everywhere, WORLD, {"universal": baseline["universal"], "reshaped": baseline["src"]},
                     cases, timeout=600)


@pytest.fixture(scope="module")
def resumed(baseline):
    return resume_cases(baseline, [c for c in CASES if c in DEFAULT])


@pytest.fixture(scope="module")
def resumed_slow(baseline):
    return resume_cases(baseline, [c for c in CASES if c not in DEFAULT])


def test_universal_files(baseline):
    """SwiGLU's [gate; up] is written whole, marked as two sub-parameters; the untied head is a vocab tensor;
    the standalone zero_to_fp32.py merges the same full tensors from the plain checkpoint."""
    cfg, zero = config(), os.path.join(baseline["universal"], "zero")
    names = sorted(os.listdir(zero))
    assert "1.word_embeddings.weight" in names and "7.lm_head.weight" in names and "6.bias" not in names
    mlp = load_any(os.path.join(zero, "3.mlp.dense_h_to_4h.weight", "fp32.pt"))
    assert mlp["param"].shape == (2 * cfg.ffn_hidden_size, cfg.hidden_size)
    assert mlp["cat_dim"] == 0 and mlp["param_n_sub_params"] == 2
    qkv = load_any(os.path.join(zero, "3.self_attention.query_key_value.weight", "fp32.pt"))
    assert qkv["param"].shape == (cfg.qkv_size, cfg.hidden_size) and "param_n_sub_params" not in qkv
    head = load_any(os.path.join(zero, "7.lm_head.weight", "fp32.pt"))
    assert head["param"].shape == (cfg.vocab_size, cfg.hidden_size) and head["vocab_tensor"] is True
    consolidated = get_fp32_state_dict_from_zero_checkpoint(os.path.dirname(baseline["src"]))
    assert sorted(consolidated) == [n for n in names if os.path.isdir(os.path.join(zero, n))]
    for name, t in consolidated.items():
        assert torch.equal(t, load_any(os.path.join(zero, name, "fp32.pt"))["param"]), name


NAMES = {(1, 1, 1): "tp1-dp8", (4, 1, 1): "tp4-dp2", (1, 4, 1): "pp4-dp2", (2, 1, 1): "tp2-dp4",
         (2, 1, 3): "tp2-dp4-zero3"}


@pytest.mark.parametrize("kind,tp,pp,stage", [
    pytest.param(*case, marks=() if case in DEFAULT else pytest.mark.slow, id=f"{NAMES[case[1:]]}-{case[0]}")
    for case in CASES])  # slow ones: the same kind or layout is resumed in DEFAULT (see above)
def test_resume_matches_uninterrupted_run(request, baseline, kind, tp, pp, stage):
    resumed = request.getfixturevalue("resumed" if (kind, tp, pp, stage) in DEFAULT else "resumed_slow")
    results = [rank_results[(kind, tp, pp, stage)] for rank_results in resumed]
    want = baseline["losses"]
    for _, losses, _ in results:
        assert sorted(losses) == list(range(SAVE_AT, ITERS))
        for it, loss in losses.items():
            assert abs(loss - want[it]) <= 1e-5 * abs(want[it]), (it, loss, want[it])
    got = full_weights(results, config())
    assert set(got) == set(baseline["weights"])
    for name, w in baseline["weights"].items():
        torch.testing.assert_close(got[name], w, rtol=1e-5, atol=1e-5, msg=name)
