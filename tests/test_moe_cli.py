"""MoE through pretrain_gpt.py, as users run it: 4 ranks at EP2 (DP4, expert-DP 2), 4 experts top-2 with
the switch aux loss and the z-loss; a checkpoint in DeepSpeed-MoE's layout (per-expert files) resumed at
the same layout gives the uninterrupted run's losses bit-identically (same ranks, same operations, same
order, on the restored weights, Adam state, schedule and data position), and resumed with --moe-grouped-gemm
and --overlap-grad-reduce / --overlap-param-gather gives them to roundoff; converted by tools/ds_to_universal.py
and resumed with --universal-checkpoint at EP1, or loaded directly at EP4 and at TP2, it gives them to
roundoff; exporting it (GPT-2 layers) to Hugging Face is refused in one sentence; the MoE losses are logged."""
import os
import re
import subprocess
import sys

import pytest

from megatron_zero.testing.cli import CliResume, cli_flags, text_data
from megatron_zero.testing.launch import ROOT, torchrun

pytestmark = [pytest.mark.multirank, pytest.mark.slow]

MOE = {"num-experts": 4, "moe-router-topk": 2, "moe-aux-loss-coeff": 1e-2, "moe-z-loss-coeff": 1e-3,
       "expert-model-parallel-size": 2}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe_cli")
    data = text_data(root / "text")
    cache = str(root / "cache")
    return CliResume(str(root), lambda *changes: cli_flags(data, cache, "gpt2", MOE, *changes),
                     {"zero-stage": 2}, nproc=4, iters=4, save_at=2)


def test_moe_checkpoint_files_and_resume_as_saved(run):
    files = set(os.listdir(run.checkpoint))
    experts = {f"layer_{m}_expert_{e}_mp_rank_00_model_states.pt" for m in range(2) for e in range(4)}
    assert experts <= files, sorted(files)
    assert {f"zero_pp_rank_{d}_mp_rank_00_optim_states.pt" for d in range(4)} <= files
    run.assert_matches(run.resume("as saved"), 0.0)


def test_moe_resume_with_grouped_gemm_and_overlap(run):
    """A checkpoint of a run without --moe-grouped-gemm resumes with it (the experts keep their parameters,
    moe/grouped_mlp.py) and with --overlap-grad-reduce / --overlap-param-gather (expert buckets over expert-DP):
    the uninterrupted run's losses to model_rtol of one step's path (the grouped GeLU experts add their bias
    unfused, and at DP 4 an async reduce-scatter may sum in another order: roundoff only; where Adam
    amplifies it, on near-zero gradient elements, the loss moves to second order). Measured: equal to the
    7 digits logged."""
    from megatron_zero.model.config import GPTConfig
    from megatron_zero.testing.tolerances import gpt_path_length, model_rtol

    cfg = GPTConfig(vocab_size=257, hidden_size=32, num_layers=2, num_attention_heads=4, seq_length=16,
                    max_position_embeddings=16)  # TINY of megatron_zero/testing/cli.py
    resumed = run.resume("as saved", {"moe-grouped-gemm": True, "overlap-grad-reduce": True,
                                      "overlap-param-gather": True})
    run.assert_matches(resumed, model_rtol(gpt_path_length(cfg, 8 * 16)))


def _reshaped_rtol():
    """model_rtol of one step's path of the tiny model (TINY of megatron_zero/testing/cli.py): another EP, DP
    or TP sums in another order (the experts' gradients over another expert-DP group, TP partial sums),
    roundoff only, as in test_moe_resume_with_grouped_gemm_and_overlap."""
    from megatron_zero.model.config import GPTConfig
    from megatron_zero.testing.tolerances import gpt_path_length, model_rtol

    cfg = GPTConfig(vocab_size=257, hidden_size=32, num_layers=2, num_attention_heads=4, seq_length=16,
                    max_position_embeddings=16)
    return model_rtol(gpt_path_length(cfg, 8 * 16))


def test_moe_universal_resume_at_expert_parallel_1(run):
    """tools/ds_to_universal.py converts the EP2 checkpoint (every expert under its global id) and
    pretrain_gpt.py --universal-checkpoint resumes it at EP1 (each rank all four experts, DP4)."""
    experts = {f"{i}.mlp.deepspeed_moe.experts.deepspeed_experts.{e}.{w}" for i in (2, 3) for e in range(4)
               for w in ("dense_h_to_4h.weight", "dense_4h_to_h.weight")}
    assert experts <= set(os.listdir(os.path.join(run.universal, "zero")))
    run.assert_matches(run.resume("universal", {"expert-model-parallel-size": 1}), _reshaped_rtol())


def test_moe_reshaped_resume_at_expert_parallel_4_tensor_parallel_2(run):
    """--load of the plain EP2 x DP4 checkpoint at TP2 x DP2 x EP2 and at EP4 x DP4, no conversion."""
    run.assert_matches(run.resume("reshaped", {"expert-model-parallel-size": 4}), _reshaped_rtol())
    run.assert_matches(run.resume("reshaped", {"tensor-model-parallel-size": 2}), _reshaped_rtol())


def test_moe_losses_logged(tmp_path):
    data = text_data(tmp_path / "text")
    done = torchrun(2, cli_flags(data, str(tmp_path / "cache"), "llama",
                                 {**MOE, "moe-layer-freq": 2, "train-iters": 2}))
    assert done.returncode == 0, done.stderr[-2000:]
    values = re.findall(r"load_balancing_loss: ([0-9.E+-]+) \| z_loss: ([0-9.E+-]+)", done.stdout)
    assert len(values) == 2
    for lb, z in values:  # a switch loss near 1 is balanced routing; the z-loss is a mean of squares
        assert 0.9 < float(lb) < 2.0 and float(z) > 0


def test_gpt2_moe_checkpoint_hf_export_is_refused(run, tmp_path):
    """GPT-2 layers with MoE have no Hugging Face architecture (Mixtral and Qwen2-MoE are Llama-style: their
    trained checkpoints export, tests/test_cli_hf_moe.py)."""
    done = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "convert_to_hf.py"), run.checkpoint,
                           str(tmp_path / "hf")], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "no Hugging Face architecture holds this model" in done.stderr + done.stdout
    assert "Traceback" not in done.stderr + done.stdout


# Megatron-DeepSpeed's MoE flags (ds_pretrain_gpt_125M_MoE64.sh's): DeepSpeed-MoE's capacity gating, top-1 with
# random token selection (capacity 8 of a micro-batch's 32 tokens per expert), hidden dropout, full recompute,
# ZeRO 0 with expert parallelism
MDS_MOE = {"num-experts": 4, "moe-expert-parallel-size": 2, "moe-loss-coeff": 1e-2, "moe-train-capacity-factor": 1.0,
           "moe-eval-capacity-factor": 1.0, "moe-min-capacity": 4, "expert-interval": 1, "create-moe-param-group": True,
           "checkpoint-activations": True, "hidden-dropout": 0.1}


def test_megatron_deepspeed_moe_flags_resume_bit_identically(tmp_path):
    """Random token selection and dropout draw from the generators the checkpoint restores, and the
    recompute routes as the forward did: the resumed run repeats the uninterrupted one's losses exactly."""
    data = text_data(tmp_path / "text")
    run = CliResume(str(tmp_path), lambda *c: cli_flags(data, str(tmp_path / "cache"), "gpt2", MDS_MOE, *c),
                    {"zero-stage": 0}, nproc=2, iters=4, save_at=2)
    files = set(os.listdir(run.checkpoint))
    assert {f"layer_{m}_expert_{e}_mp_rank_00_model_states.pt" for m in range(2) for e in range(4)} <= files
    run.assert_matches(run.resume("as saved"), 0.0)
