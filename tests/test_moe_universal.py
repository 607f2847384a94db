"""Reshaping MoE checkpoints: a run saved at EP2 x DP4 (expert-DP 2) ZeRO-1, converted with
ds_to_universal (or loaded directly, reshaped), resumed at another EP, DP, TP, PP and ZeRO stage.

The universal files hold every expert under its global id, bit-identical to the fp32 masters and Adam
moments the saving ranks' optimizers owned (each expert's fragments gathered from its expert-DP group).
Each resume's losses match the single-process reference's, which never stopped (each step's
micro-batches those of its layout: the aux losses are per micro-batch), to model_rtol of one step's
path (megatron_zero/testing/tolerances.py), as tests/test_moe_parity.py holds uninterrupted runs to."""
import os

import pytest
import torch

from megatron_zero.checkpoint.reshape.universal_convert import convert_to_universal
from megatron_zero.checkpoint.storage.tensor_io import load_file
from megatron_zero.testing import run_ranks
from megatron_zero.testing.moe_reshape import SAVE_AT, moe_run, reference_resumed
from megatron_zero.testing.moe_train import GBS, MOE, STEPS, moe_config, reference_run
from megatron_zero.testing.tiny_gpt import tiny_gpt_config
from megatron_zero.testing.tolerances import assert_losses_close, gpt_path_length, model_rtol

pytestmark = pytest.mark.multirank

SAVED = dict(tp=1, pp=1, dp=4, ep=2, stage=1, mb=2)


def _save_and_convert(root: str, cfg, layout: dict = SAVED) -> dict:
    results = run_ranks(moe_run, layout["tp"] * layout["pp"] * layout["dp"], cfg, layout["tp"], layout["pp"],
                        layout["ep"], layout["stage"], layout["mb"], root, steps=SAVE_AT, timeout=600)
    src = os.path.join(root, f"global_step{SAVE_AT}")
    out = src + "_universal"
    summary = convert_to_universal(src, out, merge_workers=1, progress=False)
    assert summary["mismatched"] == []
    ref_losses, _ = reference_run(cfg, layout["dp"], layout["mb"])
    for losses, _, _ in results:  # the run that saved is itself the reference's, to its step
        assert_losses_close([losses[s] for s in range(SAVE_AT)], ref_losses[:SAVE_AT], _rtol(cfg), "saved run loss")
    return {"cfg": cfg, "results": results, "src": src, "universal": out, "reference": ref_losses, "layout": layout}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """4 experts (2 per EP rank), 4 MoE layers: each EP rank's expert group halves over expert-DP between
    experts."""
    return _save_and_convert(str(tmp_path_factory.mktemp("moe_universal")), moe_config(False))


@pytest.fixture(scope="module")
def straddled(tmp_path_factory):
    """2 experts (1 per EP rank), 3 MoE layers: each EP rank's expert group (3 experts' parameters) halves
    over expert-DP inside the middle layer's expert, whose parameters two ZeRO files then share."""
    cfg = tiny_gpt_config(num_layers=3, **{**MOE, "num_experts": 2})
    return _save_and_convert(str(tmp_path_factory.mktemp("moe_straddled")), cfg)


@pytest.fixture(scope="module")
def tp2_llama(tmp_path_factory):
    """Llama (SwiGLU experts: [gate; up] merged half by half over TP) saved at TP2 x DP2 x EP2 ZeRO-2."""
    return _save_and_convert(str(tmp_path_factory.mktemp("moe_tp2_llama")), moe_config(True),
                             dict(tp=2, pp=1, dp=2, ep=2, stage=2, mb=2))


def _rtol(cfg):
    return model_rtol(gpt_path_length(cfg, GBS * cfg.seq_length))


@pytest.mark.parametrize("which", ["straddled", pytest.param("saved", marks=pytest.mark.slow)])
def test_moe_universal_files_hold_what_the_ranks_held(request, which):
    """Every expert of every MoE layer, and every dense parameter, under its global name: fp32 master and
    both moments equal, bit for bit, to the fragments the saving ranks owned (TP1: TP form is full form)."""
    saved = request.getfixturevalue(which)
    owned = {}
    for _, frags, _ in saved["results"]:
        for name, pieces in frags.items():
            owned.setdefault(name, []).extend(pieces)
    cfg = saved["cfg"]
    experts = {n for n in owned if ".deepspeed_experts." in n}
    assert len(experts) == cfg.num_layers * cfg.num_experts * 4  # GeLU experts: two weights, two biases
    if which == "straddled":  # the point of this checkpoint: an expert parameter in two ranks' ZeRO files
        assert any(len(owned[n]) > 1 for n in experts)
    zero = os.path.join(saved["universal"], "zero")
    assert set(os.listdir(zero)) - {"optimizer_state.pt"} == set(owned)
    for name, pieces in owned.items():
        for key in ("fp32", "exp_avg", "exp_avg_sq"):
            full = load_file(os.path.join(zero, name, f"{key}.pt"))["param"].reshape(-1)
            total = sum(f[key].numel() for _, f in pieces)
            assert total >= full.numel(), (name, key, total)  # the vocabulary's padded rows are cut
            flat = torch.full((total,), float("nan"))
            for start, f in pieces:
                flat.narrow(0, start, f[key].numel()).copy_(f[key])
            assert torch.equal(full, flat[:full.numel()]), (name, key)
        assert int(load_file(os.path.join(zero, name, "step.pt"))) == SAVE_AT


TARGETS = {  # name: (tp, pp, dp, ep, zero stage, micro-batch, universal or reshaped)
    "ep1_dp2_zero2": (1, 1, 2, 1, 2, 2, "universal"),
    "ep4_dp4_zero1": (1, 1, 4, 4, 1, 2, "universal"),
    "ep2_tp2_dp2_zero1": (2, 1, 2, 2, 1, 2, "universal"),
    "ep2_pp2_dp2_zero2": (1, 2, 2, 2, 2, 1, "universal"),
    "ep1_dp1_zero1_ga8": (1, 1, 1, 1, 1, 1, "universal"),
    "ep1_dp2_zero3": (1, 1, 2, 1, 3, 2, "universal"),  # ZeRO-3 with EP > 1 is refused (training too)
    "reshaped_ep1_tp2_zero1": (2, 1, 1, 1, 1, 2, "reshaped"),
    "reshaped_ep4_dp4_zero2": (1, 1, 4, 4, 2, 2, "reshaped"),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(TARGETS))
def test_moe_resume_at_another_layout(saved, name):
    check_resume(saved, name)


@pytest.mark.slow
def test_moe_resume_straddled_at_expert_parallel_1(straddled):
    check_resume(straddled, "ep1_dp2_zero2")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["ep1_dp2_zero2", "reshaped_ep4_dp4_zero2"])
def test_moe_tp2_llama_resume(tp2_llama, name):
    """The experts' TP slices merged (universal) or re-split (reshaped) from a TP2 source."""
    check_resume(tp2_llama, name)


def check_resume(saved, name):
    tp, pp, dp, ep, stage, mb, kind = TARGETS[name]
    load = saved["universal"] if kind == "universal" else saved["src"]
    results = run_ranks(moe_run, tp * pp * dp, saved["cfg"], tp, pp, ep, stage, mb, None, load, kind,
                        timeout=600)
    before = (saved["layout"]["dp"], saved["layout"]["mb"])
    want = saved["reference"][SAVE_AT:] if (dp, mb) == before else \
        reference_resumed(saved["cfg"], before, (dp, mb))[SAVE_AT:]
    for losses, _, _ in results:
        assert sorted(losses) == list(range(SAVE_AT, STEPS))
        assert_losses_close([losses[s] for s in range(SAVE_AT, STEPS)], want, _rtol(saved["cfg"]), f"{name} loss")


def test_moe_zero_to_fp32_consolidates_every_expert(straddled):
    saved = straddled
    """tools/zero_to_fp32.py's consolidation of the plain MoE checkpoint: every expert, the universal
    file's fp32 tensors exactly."""
    from megatron_zero.checkpoint.export.consolidate import get_fp32_state_dict
    sd = get_fp32_state_dict(saved["src"])
    zero = os.path.join(saved["universal"], "zero")
    assert set(sd) == set(os.listdir(zero)) - {"optimizer_state.pt"}
    assert sum(".deepspeed_experts." in n for n in sd) == saved["cfg"].num_layers * saved["cfg"].num_experts * 4
    for name, t in sd.items():
        assert torch.equal(t, load_file(os.path.join(zero, name, "fp32.pt"))["param"]), name


def test_moe_checkpoint_zero_to_fp32_script(straddled):
    saved = straddled
    """The zero_to_fp32.py a checkpoint carries (standalone, torch only): the same tensors."""
    from megatron_zero.checkpoint.export.consolidate import get_fp32_state_dict
    from megatron_zero.checkpoint.export.standalone_zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    want = get_fp32_state_dict(saved["src"])
    got = get_fp32_state_dict_from_zero_checkpoint(saved["src"])
    assert set(got) == set(want)
    for name, t in want.items():
        assert torch.equal(got[name], t), name
