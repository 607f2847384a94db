"""Muon (--optimizer muon/dist_muon) sharded by ZeRO against the one-process reference (testing/muon_train.py:
emerging-optimizers' Newton-Schulz, Megatron-Core's Muon, on the reference model): the losses of every step and
the final weights, at TP x PP x DP ZeRO-1 and DP ZeRO-3 with --muon-tp-mode duplicated, TP2 blockwise against the
reference orthogonalizing the same TP blocks, TP2 distributed, and EP2 MoE experts as matrices of their own."""
import pytest

from megatron_zero.model.params import param_spec
from megatron_zero.model.sharding import unpad_vocab
from megatron_zero.testing import run_ranks
from megatron_zero.testing.layout_train import full_weights
from megatron_zero.testing.moe_train import GBS, moe_config
from megatron_zero.testing.muon_train import parallel_run, reference_run
from megatron_zero.testing.tiny_gpt import tiny_gpt_config, tiny_llama_config
from megatron_zero.testing.tolerances import assert_close_normwise, assert_losses_close, gpt_path_length, model_rtol

pytestmark = pytest.mark.multirank

LAYOUTS = {  # name: (tp, pp, dp, zero stage, --muon-tp-mode, the reference's TP blocks)
    "tp2_pp2_dp2_zero1_duplicated": (2, 2, 2, 1, "duplicated", 1),
    "dp2_zero3_duplicated": (1, 1, 2, 3, "duplicated", 1),
    "tp2_blockwise": (2, 1, 1, 1, "blockwise", 2),
    "tp2_dp2_zero2_distributed": (2, 1, 2, 2, "distributed", 1),
}
# 8 ranks (37 s) and 4 ranks (18 s); in the default tier dp2_zero3_duplicated (ownership and the partition's
# gather / reduce-scatter), tp2_blockwise (TP shards) and the unit tests of test_muon.py (duplicated and distributed
# TP against Megatron-Core's newton_schulz_tp) cover their claims
SLOW = {"tp2_pp2_dp2_zero1_duplicated", "tp2_dp2_zero2_distributed"}


def _check(name, cfg, results, ref_losses, ref_weights):
    rtol = model_rtol(gpt_path_length(cfg, GBS * cfg.seq_length))
    for _, losses, _, _ in results:
        assert_losses_close(losses, ref_losses, rtol, f"{name} loss")
    full = full_weights([(c, losses, w) for c, losses, w, _ in results], cfg)
    for _, _, w, _ in results:  # at TP1 an expert is whole on the ranks of its expert-parallel index
        full.update({n: t for n, t in w.items() if n not in full})
    worst = 0.0  # the largest share of its bound a weight's difference reaches
    for n, want in ref_weights.items():
        spec = param_spec(n, cfg)
        want = unpad_vocab(want, cfg.vocab_size) if spec.is_vocab else want
        worst = max(worst, assert_close_normwise(full[n], want, rtol, f"{name} {n}"))
    print(f"{name}: weights within {worst:.2f} x their bound (rtol {rtol:.2e})")


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n for n in LAYOUTS])
def test_muon_matches_one_process_reference(name):
    tp, pp, dp, stage, mode, blocks = LAYOUTS[name]
    cfg = tiny_llama_config()
    ref_losses, ref_weights = reference_run(cfg, dp, 1, blocks)
    results = run_ranks(parallel_run, tp * pp * dp, cfg, tp, pp, stage, 1, mode, timeout=600)
    _check(name, cfg, results, ref_losses, ref_weights)
    for _, _, _, work in results:  # each DP rank's Newton-Schulz FLOPs: within 4/3 of the even share
        for flops in work["flops_per_rank"]:
            assert len(flops) == (dp if stage else 1) and max(flops) <= 4 / 3 * sum(flops) / len(flops), flops


@pytest.mark.parametrize("stage", [1, pytest.param(3, marks=pytest.mark.slow)])  # ZeRO-3's expert half: slow
def test_muon_moe_experts_ep2_match_reference(stage):
    cfg = moe_config(True)
    ref_losses, ref_weights = reference_run(cfg, 2, 1)
    results = run_ranks(parallel_run, 2, cfg, 1, 1, stage, 1, "duplicated", ep=2, timeout=600)
    _check(f"ep2 moe zero{stage}", cfg, results, ref_losses, ref_weights)
    flops = [work["flops_per_rank"] for _, _, _, work in results]
    # the dense matrices shared out over DP 2, each expert's orthogonalized by the one rank holding it
    assert all([len(group) for group in rank] == [2, 1] for rank in flops)


QK_CLIP = (0.5, 0.12)  # alpha, threshold: the tiny model's max logits (0.10 to 0.17) pass it at some steps
# name: (tp, dp, zero stage, attention backend); flash: torch's kernel that never builds the scores
QK_LAYOUTS = {"dp2_zero1_flash": (1, 2, 1, "flash"), "tp2_dp2_zero3": (2, 2, 3, "auto")}


@pytest.mark.parametrize("name", ["dp2_zero1_flash", pytest.param("tp2_dp2_zero3", marks=pytest.mark.slow)])
def test_qk_clip_matches_megatron_core_clip(name):
    """QK-clip (the max logit reduced over DP, q and k scaled on the masters' fragments) against the reference
    applying Megatron-Core's own _clip_linear_qkv after each step. (tp2_dp2_zero3, 4 ranks, slow: TP's heads and
    ZeRO-3's per-parameter chunks; dp2_zero1_flash covers the reduction and the fragments' scaling.)"""
    tp, dp, stage, backend = QK_LAYOUTS[name]
    cfg = tiny_llama_config(attention_backend=backend)
    ref_losses, ref_weights, ref_logits = reference_run(cfg, dp, 1, qk_clip=QK_CLIP)
    assert max(ref_logits) > QK_CLIP[1], "no layer passed the threshold: the test does not exercise the clip"
    unclipped = reference_run(cfg, dp, 1)[0]
    assert unclipped[-1] != ref_losses[-1]
    results = run_ranks(parallel_run, tp * dp, cfg, tp, 1, stage, 1, "duplicated", qk_clip=QK_CLIP, timeout=600)
    _check(f"qk-clip {name}", cfg, results, ref_losses, ref_weights)
    rtol = model_rtol(gpt_path_length(cfg, GBS * cfg.seq_length))
    for _, _, _, work in results:
        assert_losses_close(work["max_logits"], ref_logits, rtol, f"qk-clip {name} max logit")


def _trainer_losses(argv):
    from megatron_zero.testing.trainer_losses import recorded_training
    return recorded_training(argv)[1]


@pytest.mark.slow  # 3 ranks of the real Trainer, ~30 s; in the default tier dp2_zero3_duplicated (owners over the
# gradient's group) and tests/test_muon.py's max logit over CP ranks
def test_muon_with_qk_clip_at_context_parallel_2_matches_one_rank(builtin_corpus, tmp_path):
    """The real Trainer, dist_muon with QK-clip: at CP 2 (owners over the DP x CP group, each head's max logit over
    the CP ranks' keys) the losses of one rank without context parallelism."""
    from megatron_zero.testing.trainer_losses import resume_flags
    flags = {"train-iters": 4, "hidden-dropout": 0.0, "attention-dropout": 0.0, "optimizer": "dist_muon",
             "muon-tp-mode": "duplicated", "muon-fp32-matmul-prec": "highest", "muon-use-nesterov": True,
             "qk-clip": True, "qk-clip-threshold": 0.5, "log-interval": 1}
    one = run_ranks(_trainer_losses, 1, resume_flags(builtin_corpus, tmp_path / "one", 1, 1, 1, **flags),
                    timeout=600)[0]
    cp2 = run_ranks(_trainer_losses, 2, resume_flags(builtin_corpus, tmp_path / "cp2", 1, 1, 1,
                                                     **flags, **{"context-parallel-size": 2}), timeout=600)
    cfg = tiny_gpt_config(2, seq_length=32, max_position_embeddings=32, vocab_size=2048)  # resume_flags' GPT
    for losses in cp2:
        assert_losses_close(losses, one, model_rtol(gpt_path_length(cfg, 8 * 32)), "cp2 loss")
