"""MoE checkpoints at ZeRO-3 with expert parallelism (zero/expert_stage3.py): saved at EP2 x DP4 (expert-DP 2),
with DeepSpeed-MoE's per-expert files; converted by ds_to_universal (every expert's fp32 master and Adam moments
bit-identical to the fragments the saving ranks' optimizers owned), consolidated by zero_to_fp32 (ours and the
standalone script a checkpoint carries), resumed as saved (also into an NVMe-offloaded optimizer) and out to
EP1 x ZeRO-1 (universal and reshaped). And a TP2 x PP2 x DP2 x EP2 ZeRO-1 checkpoint resumed into ZeRO-3 at EP2
(universal and reshaped). Each resume's losses match the single-process reference that never stopped, to
model_rtol of one step's path (as tests/test_moe_universal.py holds its resumes). The 16-bit model
--save-16bit-model writes from either holds every expert: the fp32 masters cast."""
import os

import pytest
import torch

from megatron_zero.checkpoint.reshape.universal_convert import convert_to_universal
from megatron_zero.checkpoint.storage.tensor_io import load_file
from megatron_zero.testing import run_ranks
from megatron_zero.testing.moe_reshape import SAVE_AT, moe_run, reference_resumed
from megatron_zero.testing.moe_train import GBS, STEPS, moe_config, reference_run
from megatron_zero.testing.tolerances import assert_losses_close, gpt_path_length, model_rtol

pytestmark = [pytest.mark.multirank, pytest.mark.slow]  # each source run saves on 4 to 8 ranks (> 30 s)


def _rtol(cfg):
    return model_rtol(gpt_path_length(cfg, GBS * cfg.seq_length))


def _save_and_convert(root: str, cfg, layout: dict) -> dict:
    tp, pp, dp = layout["tp"], layout["pp"], layout["dp"]
    results = run_ranks(moe_run, tp * pp * dp, cfg, tp, pp, layout["ep"], layout["stage"], layout["mb"], root,
                        steps=SAVE_AT, timeout=900)
    src = os.path.join(root, f"global_step{SAVE_AT}")
    out = src + "_universal"
    assert convert_to_universal(src, out, merge_workers=1, progress=False)["mismatched"] == []
    ref_losses, _ = reference_run(cfg, dp, layout["mb"])
    for losses, _, _ in results:  # the run that saved is itself the reference's, to its step
        assert_losses_close([losses[s] for s in range(SAVE_AT)], ref_losses[:SAVE_AT], _rtol(cfg), "saved run loss")
    return {"cfg": cfg, "results": results, "src": src, "universal": out, "reference": ref_losses, "layout": layout}


@pytest.fixture(scope="module")
def zero3(tmp_path_factory):
    """GPT, 4 experts in each of 4 MoE layers, saved at EP2 x DP4 ZeRO-3."""
    return _save_and_convert(str(tmp_path_factory.mktemp("moe_zero3")), moe_config(False),
                             dict(tp=1, pp=1, dp=4, ep=2, stage=3, mb=2))


@pytest.fixture(scope="module")
def tp2_pp2(tmp_path_factory):
    """GPT saved at TP2 x PP2 x DP2 x EP2 ZeRO-1 (8 ranks)."""
    return _save_and_convert(str(tmp_path_factory.mktemp("moe_tp2_pp2")), moe_config(False),
                             dict(tp=2, pp=2, dp=2, ep=2, stage=1, mb=2))


def test_moe_zero3_checkpoint_files_and_universal(zero3):
    """Per-expert files for every global expert id; the universal files equal, bit for bit, what the saving ranks'
    ZeRO-3 partitions held (experts chunked over expert-DP), and zero_to_fp32 gives the universal fp32."""
    from megatron_zero.checkpoint.export.consolidate import get_fp32_state_dict
    from megatron_zero.checkpoint.export.standalone_zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    cfg = zero3["cfg"]
    files = os.listdir(zero3["src"])
    assert {f"layer_{m}_expert_{e}_mp_rank_00_model_states.pt" for m in range(cfg.num_layers)
            for e in range(cfg.num_experts)} <= set(files)
    owned = {}
    for _, frags, _ in zero3["results"]:
        for name, pieces in frags.items():
            owned.setdefault(name, []).extend(pieces)
    experts = {n for n in owned if ".deepspeed_experts." in n}
    assert len(experts) == cfg.num_layers * cfg.num_experts * 4  # GeLU experts: two weights, two biases
    assert all(len(owned[n]) == 2 for n in experts)  # each expert parameter chunked over its expert-DP pair
    zero = os.path.join(zero3["universal"], "zero")
    assert set(os.listdir(zero)) - {"optimizer_state.pt"} == set(owned)
    for name, pieces in owned.items():
        for key in ("fp32", "exp_avg", "exp_avg_sq"):
            full = load_file(os.path.join(zero, name, f"{key}.pt"))["param"].reshape(-1)
            flat = torch.full((sum(f[key].numel() for _, f in pieces),), float("nan"))
            for start, f in pieces:
                flat.narrow(0, start, f[key].numel()).copy_(f[key])
            assert torch.equal(full, flat[:full.numel()]), (name, key)
    ours, standalone = get_fp32_state_dict(zero3["src"]), get_fp32_state_dict_from_zero_checkpoint(zero3["src"])
    assert set(ours) == set(standalone) == set(owned)
    for name in ours:
        want = load_file(os.path.join(zero, name, "fp32.pt"))["param"]
        assert torch.equal(ours[name], want) and torch.equal(standalone[name], want), name
    # the expert files hold each expert's weights in the model's dtype (fp32 here): the masters themselves
    sd = load_file(os.path.join(zero3["src"], "layer_1_expert_3_mp_rank_00_model_states.pt"))
    assert len(sd) == 4 and all(n in experts and ".deepspeed_experts.3." in n for n in sd)
    for name, t in sd.items():
        assert torch.equal(t, ours[name]), name


TARGETS = {  # name: (tp, pp, dp, ep, zero stage, micro-batch, how it loads)
    "as_saved_zero3_ep2": (1, 1, 4, 2, 3, 2, "same"),
    "as_saved_zero3_ep2_nvme_offload": (1, 1, 4, 2, 3, 2, "same"),
    "universal_ep1_dp2_zero1": (1, 1, 2, 1, 1, 2, "universal"),
    "reshaped_ep1_dp2_zero1": (1, 1, 2, 1, 1, 2, "reshaped"),
    "universal_zero3_ep2_dp4": (1, 1, 4, 2, 3, 2, "universal"),
    "reshaped_zero3_ep2_dp4": (1, 1, 4, 2, 3, 2, "reshaped"),
}


@pytest.mark.parametrize("name", ["as_saved_zero3_ep2", "as_saved_zero3_ep2_nvme_offload", "universal_ep1_dp2_zero1",
                                  "reshaped_ep1_dp2_zero1"])
def test_moe_zero3_resumes(zero3, name, tmp_path):
    check_resume(zero3, name, nvme_path=str(tmp_path) if "nvme" in name else None)


@pytest.mark.parametrize("name", ["universal_zero3_ep2_dp4", "reshaped_zero3_ep2_dp4"])
def test_moe_tp2_pp2_resumes_at_zero3(tp2_pp2, name):
    check_resume(tp2_pp2, name)


def check_resume(saved, name, nvme_path=None):
    tp, pp, dp, ep, stage, mb, kind = TARGETS[name]
    load = saved["universal"] if kind == "universal" else saved["src"]
    results = run_ranks(moe_run, tp * pp * dp, saved["cfg"], tp, pp, ep, stage, mb, None, load, kind, timeout=900,
                        offload="nvme" if nvme_path else "none", nvme_path=nvme_path)
    before = (saved["layout"]["dp"], saved["layout"]["mb"])
    want = saved["reference"][SAVE_AT:] if (dp, mb) == before else \
        reference_resumed(saved["cfg"], before, (dp, mb))[SAVE_AT:]
    for losses, _, _ in results:
        assert sorted(losses) == list(range(SAVE_AT, STEPS))
        assert_losses_close([losses[s] for s in range(SAVE_AT, STEPS)], want, _rtol(saved["cfg"]), f"{name} loss")


def _masters(results) -> dict:
    """name -> the full fp32 master the saving ranks' optimizers held (TP1: the TP form is the full form)."""
    owned = {}
    for _, frags, _ in results:
        for name, pieces in frags.items():
            owned.setdefault(name, []).extend(pieces)
    out = {}
    for name, pieces in owned.items():
        flat = torch.full((sum(f["fp32"].numel() for _, f in pieces),), float("nan"))
        for start, f in pieces:
            flat.narrow(0, start, f["fp32"].numel()).copy_(f["fp32"])
        out[name] = flat
    return out


def test_moe_save_16bit_model_holds_every_expert(zero3, tp2_pp2, tmp_path):
    """save_16bit_model (what --save-16bit-model runs after each save) of the ZeRO-3 EP2 x DP4 checkpoint: every
    parameter and every expert under its global id, equal to the fp32 masters the ranks held cast to bf16, bit for
    bit, read back by load_consolidated; of the TP2 x PP2 x DP2 x EP2 ZeRO-1 one, the same bytes as
    tools/zero_to_fp32.py --dtype bf16 writes offline."""
    import subprocess
    import sys

    from megatron_zero.checkpoint.export.consolidate import get_fp32_state_dict, load_consolidated
    from megatron_zero.checkpoint.export.save_16bit import save_16bit_model
    from megatron_zero.testing.launch import ROOT

    cfg = zero3["cfg"]
    got = load_consolidated(save_16bit_model(zero3["src"], torch.bfloat16))
    masters = _masters(zero3["results"])
    assert set(got) == set(masters)
    assert sum(".deepspeed_experts." in n for n in got) == cfg.num_layers * cfg.num_experts * 4
    for name, t in got.items():
        assert t.dtype == torch.bfloat16 and torch.equal(t.reshape(-1), masters[name][:t.numel()].to(torch.bfloat16)), name
    got = load_consolidated(save_16bit_model(tp2_pp2["src"], torch.bfloat16))
    want = get_fp32_state_dict(tp2_pp2["src"])
    assert set(got) == set(want) and sum(".deepspeed_experts." in n for n in got) == cfg.num_layers * cfg.num_experts * 4
    assert all(torch.equal(got[n], t.to(torch.bfloat16)) for n, t in want.items())
    done = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "zero_to_fp32.py"), tp2_pp2["src"],
                           str(tmp_path / "offline"), "--safe_serialization", "--dtype", "bf16", "--quiet"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    offline = load_consolidated(str(tmp_path / "offline"))
    assert set(offline) == set(got) and all(torch.equal(offline[n], t) for n, t in got.items())
