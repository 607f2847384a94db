"""Sequence parallelism and --expert-tensor-parallel-size with MoE through pretrain_gpt.py, as users run them:
4 ranks at TP2 x DP2, EP2, --sequence-parallel (each TP rank routes its sequence chunk), 4 experts top-2
with the aux and z losses, saving at iteration 2. The checkpoint resumes as saved bit-identically and
without --sequence-parallel to roundoff (sequence parallelism changes no parameter); the same run at
--expert-tensor-parallel-size 1 (every expert whole, on ranks carved out of TP x DP as Megatron-Core does)
gives the same losses to roundoff; the MoE losses are logged. A run at --expert-tensor-parallel-size 1
saves its experts whole (expert files numbered pp x ETP + etp: mp_rank 00 only), records ETP in the
layout and resumes as saved bit-identically, and at ETP = TP (reshaped while loading, and through
tools/ds_to_universal.py and --universal-checkpoint: the experts' slices merged by ETP) to roundoff;
tools/zero_to_fp32.py consolidates it; a run at ETP 1 loading a checkpoint of another layout, and the
checkpoint's own copy of zero_to_fp32.py, are refused in one sentence."""
import os
import subprocess
import sys

import pytest

from megatron_zero.model.config import GPTConfig
from megatron_zero.testing.cli import CliResume, cli_flags, logged_losses, pretrain_cli, text_data, tool
from megatron_zero.testing.launch import torchrun
from megatron_zero.testing.tolerances import gpt_path_length, model_rtol

pytestmark = [pytest.mark.multirank, pytest.mark.slow]

MOE = {"num-experts": 4, "moe-router-topk": 2, "moe-aux-loss-coeff": 1e-2, "moe-z-loss-coeff": 1e-3,
       "expert-model-parallel-size": 2, "sequence-parallel": True}
LAYOUT = {"tensor-model-parallel-size": 2, "zero-stage": 1}


def _rtol():
    """model_rtol of one step's path of the tiny model (TINY of megatron_zero/testing/cli.py): another
    layout sums in another order (TP partial sums, the experts' gradients over another expert-DP group)."""
    cfg = GPTConfig(vocab_size=257, hidden_size=32, num_layers=2, num_attention_heads=4, seq_length=16,
                    max_position_embeddings=16)
    return model_rtol(gpt_path_length(cfg, 8 * 16))


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe_etp_cli")
    data = text_data(root / "text")
    cache = str(root / "cache")
    return CliResume(str(root), lambda *changes: cli_flags(data, cache, "gpt2", MOE, *changes), LAYOUT,
                     nproc=4, iters=4, save_at=2)


def test_moe_sequence_parallel_logs_and_resumes_as_saved(run):
    assert "load_balancing_loss" in run.stdout and "z_loss" in run.stdout
    run.assert_matches(run.resume("as saved"), 0.0)


def test_moe_sequence_parallel_checkpoint_resumes_without_it(run):
    run.assert_matches(run.resume("as saved", {"sequence-parallel": False}), _rtol())


def test_moe_expert_tensor_parallel_1_matches_expert_tensor_parallel_2(run):
    etp1 = logged_losses(pretrain_cli(4, run.flags({"train-iters": run.iters}, LAYOUT,
                                                   {"expert-tensor-parallel-size": 1})))
    assert sorted(etp1) == sorted(run.losses)
    for it, loss in etp1.items():
        assert abs(loss - run.losses[it]) <= _rtol() * abs(run.losses[it]), (it, loss, run.losses)


@pytest.fixture(scope="module")
def run_etp1(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe_etp1_cli")
    data = text_data(root / "text")
    cache = str(root / "cache")
    return CliResume(str(root), lambda *changes: cli_flags(data, cache, "gpt2", MOE, *changes),
                     {**LAYOUT, "expert-tensor-parallel-size": 1}, nproc=4, iters=4, save_at=2)


def test_moe_expert_tensor_parallel_1_saves_and_resumes_as_saved(run_etp1):
    files = set(os.listdir(run_etp1.checkpoint))
    assert {f"layer_{m}_expert_{e}_mp_rank_00_model_states.pt" for m in range(2) for e in range(4)} <= files
    assert not any(f.startswith("layer_") and "_expert_" in f and "mp_rank_01" in f for f in files), sorted(files)
    run_etp1.assert_matches(run_etp1.resume("as saved"), 0.0)


def test_moe_expert_tensor_parallel_1_checkpoint_resumes_at_expert_tensor_parallel_2(run_etp1):
    """Loaded directly at ETP 2 (= TP): every expert's ETP slice, master and Adam moments gathered from its
    expert-DP group's files and split by TP; the uninterrupted ETP 1 run's losses to roundoff."""
    run_etp1.assert_matches(run_etp1.resume("reshaped", {"expert-tensor-parallel-size": 2}), _rtol())


def test_moe_expert_tensor_parallel_1_checkpoint_through_universal(run_etp1):
    run_etp1.assert_matches(run_etp1.resume("universal", {"expert-tensor-parallel-size": 2}), _rtol())


def test_moe_expert_tensor_parallel_1_run_loads_only_its_own_layout(run, run_etp1):
    done = torchrun(4, run_etp1.flags({"train-iters": run_etp1.iters}, LAYOUT, {"expert-tensor-parallel-size": 1},
                                      {"load": run.checkpoint}))
    assert done.returncode != 0
    assert "resumes only a checkpoint saved on its own layout" in done.stderr
    # one sentence from one rank, first (torchrun then reports the exit status in its own words)
    assert done.stderr.startswith("pretrain_gpt.py: error: ") and done.stderr.count("pretrain_gpt.py: error") == 1


def test_moe_expert_tensor_parallel_1_checkpoint_consolidates(run_etp1, tmp_path):
    """tools/zero_to_fp32.py gives every expert whole, equal to the universal checkpoint's fp32 (the same
    merge); the checkpoint's own copy of zero_to_fp32.py (which merges experts by TP) refuses in one sentence."""
    import torch

    tool("zero_to_fp32.py", run_etp1.checkpoint, tmp_path / "fp32", "--quiet")
    consolidated = torch.load(tmp_path / "fp32" / "pytorch_model.bin", weights_only=True)
    for i in (2, 3):
        for e in range(4):
            name = f"{i}.mlp.deepspeed_moe.experts.deepspeed_experts.{e}.dense_h_to_4h.weight"
            universal = torch.load(os.path.join(run_etp1.universal, "zero", name, "fp32.pt"), weights_only=True)
            universal = universal["param"] if isinstance(universal, dict) else universal
            assert torch.equal(consolidated[name], universal), name
    copied = subprocess.run([sys.executable, os.path.join(run_etp1.checkpoint, "zero_to_fp32.py"), run_etp1.checkpoint,
                             str(tmp_path / "copied")], capture_output=True, text=True, timeout=180)
    assert copied.returncode != 0
    assert "was saved at --expert-tensor-parallel-size 1" in copied.stderr and "Traceback" not in copied.stderr
