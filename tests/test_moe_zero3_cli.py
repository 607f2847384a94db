"""ZeRO-3 with expert parallelism through pretrain_gpt.py, as users run it: 4 ranks at --zero-stage 3
--expert-model-parallel-size 2 (DP4, expert-DP 2), 4 experts top-2 with the aux and z losses, the weight
matrices gathered per layer (--zero-param-persistence-threshold 100) and --save-16bit-model. The checkpoint
(DeepSpeed-MoE's per-expert files beside the ZeRO-3 files) resumes as saved bit-identically; converted by
tools/ds_to_universal.py it resumes with --universal-checkpoint at EP1 ZeRO-1, and a direct --load reshapes
it to EP1 ZeRO-2, both to model_rtol of one step's path; the 16-bit model written with the save holds every
expert, equal to tools/zero_to_fp32.py --dtype bf16 of the checkpoint."""
import os

import pytest
import torch

from megatron_zero.checkpoint.export.consolidate import load_consolidated
from megatron_zero.model.config import GPTConfig
from megatron_zero.testing.cli import CliResume, cli_flags, text_data, tool
from megatron_zero.testing.tolerances import gpt_path_length, model_rtol

pytestmark = [pytest.mark.multirank, pytest.mark.slow]

MOE = {"num-experts": 4, "moe-router-topk": 2, "moe-aux-loss-coeff": 1e-2, "moe-z-loss-coeff": 1e-3,
       "expert-model-parallel-size": 2, "zero-param-persistence-threshold": 100, "save-16bit-model": True}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe_zero3_cli")
    data = text_data(root / "text")
    cache = str(root / "cache")
    return CliResume(str(root), lambda *changes: cli_flags(data, cache, "gpt2", MOE, *changes),
                     {"zero-stage": 3}, nproc=4, iters=4, save_at=2)


def _rtol():
    """model_rtol of one step's path of the tiny model (TINY of megatron_zero/testing/cli.py): another EP, DP or
    ZeRO stage sums in another order, roundoff only."""
    cfg = GPTConfig(vocab_size=257, hidden_size=32, num_layers=2, num_attention_heads=4, seq_length=16,
                    max_position_embeddings=16)
    return model_rtol(gpt_path_length(cfg, 8 * 16))


def test_moe_zero3_checkpoint_resumes_as_saved(run):
    files = set(os.listdir(run.checkpoint))
    assert {f"layer_{m}_expert_{e}_mp_rank_00_model_states.pt" for m in range(2) for e in range(4)} <= files
    assert {f"zero_pp_rank_{d}_mp_rank_00_optim_states.pt" for d in range(4)} <= files
    run.assert_matches(run.resume("as saved"), 0.0)


def test_moe_zero3_universal_and_reshaped_resume_at_expert_parallel_1(run):
    run.assert_matches(run.resume("universal", {"expert-model-parallel-size": 1, "zero-stage": 1,
                                                "save-16bit-model": None}), _rtol())
    run.assert_matches(run.resume("reshaped", {"expert-model-parallel-size": 1, "zero-stage": 2,
                                               "save-16bit-model": None}), _rtol())


def test_moe_zero3_16bit_model_holds_every_expert(run, tmp_path):
    got = load_consolidated(os.path.join(run.checkpoint, "model_16bit"))
    assert {f"{i}.mlp.deepspeed_moe.experts.deepspeed_experts.{e}.dense_h_to_4h.weight"
            for i in (2, 3) for e in range(4)} <= set(got)
    tool("zero_to_fp32.py", run.checkpoint, tmp_path / "offline", "--safe_serialization", "--dtype", "bf16", "--quiet")
    offline = load_consolidated(str(tmp_path / "offline"))
    assert set(offline) == set(got)
    for name, t in got.items():
        assert t.dtype == torch.bfloat16 and torch.equal(t, offline[name]), name
