"""MoE layers in the interleaved pipeline (--num-layers-per-virtual-pipeline-stage): each pipeline rank holds
two model chunks of one block each (4 blocks, PP2 x DP2), the aux losses of every chunk scaled as the
language-model loss is, and expert files numbered by the model's MoE layer whichever chunk holds it.

- In process, against the single-process reference (moe_train.reference_run), fp32, 4 steps with clipping
  active: the Llama (SwiGLU experts in every other block) at EP2 on ZeRO-2, and (slow) GPT-2 (MoE in every
  block) at EP1 on ZeRO-1: loss and global gradient norm per step within tolerances.py's bounds.
- pretrain_gpt.py (slow): a Llama MoE at PP2 x DP2 x EP2, interleaved, saving at iteration 3; resumed as
  saved bit-identically, and reshaped at PP1 (no interleaving) within relative 1e-5 (tests/test_cli_resume.py's
  bound for another layout)."""
import pytest
import torch

from megatron_zero.model import reference_model
from megatron_zero.moe import reset_aux_losses, set_aux_loss_scale
from megatron_zero.pipeline.gpt_stage import activation_shape, build_gpt_stage, stage_p2p
from megatron_zero.testing import run_ranks
from megatron_zero.testing.cli import CliResume, cli_flags, text_data
from megatron_zero.testing.moe_train import CLIP, GBS, HP, global_batch, micro_slices, moe_config, reference_run
from megatron_zero.testing.tolerances import assert_losses_close, global_norm_rtol, gpt_path_length, model_rtol
from megatron_zero.testing.train_step import pipeline_train_step
from megatron_zero.distributed.topology import build_parallel_state
from megatron_zero.zero import ZeroOptimizer

pytestmark = pytest.mark.multirank
STEPS, SEQ = 4, 8
LAYOUTS = [("llama", 2, 2), pytest.param(("gpt", 1, 1), marks=pytest.mark.slow)]  # (model, EP, ZeRO stage)


def train(model, ep, stage):
    state = build_parallel_state(pp=2, ep=ep)
    cfg = moe_config(model == "llama")
    net = build_gpt_stage(cfg, state, virtual_stages=2)
    opt = ZeroOptimizer(list(net.named_parameters()), dp_group=state.dp_group, stage=stage, clip_grad=CLIP,
                        mp_group=state.mp_group, tp_rank=state.tp_rank, module=net, bucket_size=4000,
                        expert_dp_group=state.expert_dp_group, **HP)
    p2p = stage_p2p(state, activation_shape(1, cfg), torch.float32, virtual_stages=2)
    slices, m = micro_slices(state.dp_size, 1), GBS // state.dp_size
    losses, norms = [], []
    for step in range(STEPS):
        tokens, labels = global_batch(step)
        micro = [{"tokens": tokens[slices[j, state.dp_rank]], "labels": labels[slices[j, state.dp_rank]]}
                 for j in range(m)]
        set_aux_loss_scale(opt.loss_scale / m)
        loss, norm = pipeline_train_step(net, opt, state, p2p, micro)
        losses.append(loss)
        norms.append(norm)
    reset_aux_losses()
    return losses, norms


@pytest.mark.parametrize("layout", LAYOUTS)
def test_interleaved_moe_matches_reference(layout):
    cfg = moe_config(layout[0] == "llama")
    runs = run_ranks(train, 4, *layout, timeout=900)
    ref_losses, ref_norms = reference_run(cfg, 2, 1, STEPS)
    assert max(ref_norms) > CLIP  # clipping was active
    rtol = model_rtol(gpt_path_length(cfg, GBS * SEQ))
    count = sum(p.numel() for p in reference_model(cfg).parameters())
    for losses, norms in runs:
        assert_losses_close(losses, ref_losses, rtol, "loss")
        assert_losses_close(norms, ref_norms, global_norm_rtol(rtol, count), "gradient norm")


@pytest.mark.slow
def test_interleaved_moe_cli_resumes(tmp_path):
    data = text_data(str(tmp_path / "text"))
    moe = {"num-experts": 4, "moe-router-topk": 2, "moe-aux-loss-coeff": 1e-2, "moe-layer-freq": 2,
           "expert-model-parallel-size": 2, "num-layers": 4}
    run = CliResume(str(tmp_path), lambda *changes: cli_flags(data, str(tmp_path / "cache"), "llama", moe, *changes),
                    {"pipeline-model-parallel-size": 2, "num-layers-per-virtual-pipeline-stage": 1, "zero-stage": 1},
                    nproc=4)
    run.assert_matches(run.resume("as saved"), 0.0)
    run.assert_matches(run.resume("reshaped", {"pipeline-model-parallel-size": 1,
                                               "num-layers-per-virtual-pipeline-stage": None}), 1e-5)
