"""pretrain_gpt.py with --optimizer dist_muon and Megatron-LM's Muon flags, as a user runs it: Megatron-LM's
Llama-3-8B launch trains cut down with them and QK-clip; a resume switching optimizer (AdamW checkpoint -> Muon run,
and back) loads the weights, starts the new optimizer fresh and says so in one line."""
import re

import pytest

from megatron_zero.testing.launch import byte_data, losses_from_log, pretrain

MUON = {"optimizer": "dist_muon", "muon-momentum": 0.9, "muon-use-nesterov": True, "muon-scale-mode": "spectral",
        "muon-extra-scale-factor": 0.2, "muon-fp32-matmul-prec": "highest", "muon-num-ns-steps": 5,
        "muon-tp-mode": "duplicated"}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return byte_data(tmp_path_factory.mktemp("bytes") / "bytes")


def _run(tmp_path, data, **changes):
    run = pretrain(tmp_path, data, **{"train-iters": 4, "save-interval": 2, "lr": 1e-2, **changes})
    assert run.returncode == 0, run.stderr[-3000:]
    return run


def test_switching_optimizer_on_resume_loads_the_weights_and_starts_it_fresh(tmp_path, data):
    """AdamW saved at iteration 2 of 4; resumed with dist_muon (and QK-clip, logged), then that run's checkpoint
    resumed with AdamW."""
    adam = losses_from_log(_run(tmp_path / "adam", data).stdout)
    saved = tmp_path / "adam" / "ckpt" / "global_step2"
    switched = _run(tmp_path / "switched", data, load=saved, **MUON, **{"qk-clip": True, "qk-clip-threshold": 0.5})
    assert (f"the checkpoint {saved} was trained with --optimizer adamw and this run uses --optimizer dist_muon: "
            "its weights load, the optimizer starts fresh") in switched.stdout
    # iterations 3 and 4 from the checkpoint's weights: iteration 3's loss (before its step) is AdamW's, then Muon's
    resumed = losses_from_log(switched.stdout)
    assert len(resumed) == 2 and resumed[0] == adam[2] and resumed[1] != adam[3]
    assert len(re.findall(r"\| max attention logit: [0-9.]+E[+-]\d+ \|", switched.stdout)) == 2  # --log-interval 1
    back = _run(tmp_path / "back", data, load=tmp_path / "switched" / "ckpt",
                **{"train-iters": 6, "override-opt_param-scheduler": True})
    assert ("was trained with --optimizer dist_muon and this run uses --optimizer adamw: its weights load, the "
            "optimizer starts fresh") in back.stdout
    assert len(losses_from_log(back.stdout)) == 2


LLAMA3_CUT = {"--num-layers": "2", "--hidden-size": "64", "--num-attention-heads": "4", "--seq-length": "64",
              "--max-position-embeddings": "64", "--ffn-hidden-size": "128", "--global-batch-size": "4",
              "--num-query-groups": "2", "--kv-channels": "16", "--vocab-size": "512", "--train-samples": "20",
              "--lr-decay-samples": "16", "--lr-warmup-samples": "4", "--profile-step-start": "2",
              "--profile-step-end": "3", "--context-parallel-size": "2", "--attention-backend": "flash"}


@pytest.mark.slow  # 2 ranks, FP8 emulated and CP 2: ~20 s; in the default tier test_switching_optimizer_on_resume...
def test_llama3_8b_launch_with_dist_muon_and_qk_clip_trains_cut_down(tmp_path):
    """Megatron-LM's train_llama3_8b_h100_fp8.sh (FP8 with --fp8-param-gather, --decoupled-lr, overlapped ZeRO-1)
    with --optimizer dist_muon, every --muon-* flag and QK-clip, cut to 2 CPU ranks as
    tests/test_launch_scripts_train.py cuts it, those 2 ranks context-parallel (QK-clip's max logit over the CP
    ranks' keys, Muon's owners over DP x CP) with the flash backend: trains 5 iterations, logging the max attention
    logit."""
    from megatron_zero.arguments.flag_refusals import refusals
    from megatron_zero.testing.launch import torchrun
    from megatron_zero.testing.launch_scripts import replace_flag, script_argv

    paths = {n: str(tmp_path / n.lower()) for n in ("CKPT", "LOAD_CKPT", "TENSORBOARD", "DATA_CACHE")}
    argv = refusals(script_argv("megatron_lm_llama3_8b_fp8", paths))[1]
    for flag, value in LLAMA3_CUT.items():
        argv = replace_flag(argv, flag, value)
    argv += ["--fp8-emulate", "--optimizer", "dist_muon", "--muon-momentum", "0.95", "--muon-use-nesterov",
             "--muon-scale-mode", "spectral", "--muon-extra-scale-factor", "0.2", "--muon-fp32-matmul-prec", "medium",
             "--muon-num-ns-steps", "5", "--muon-tp-mode", "blockwise", "--qk-clip", "--qk-clip-alpha", "0.5",
             "--qk-clip-threshold", "100"]
    run = torchrun(2, argv, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    losses = losses_from_log(run.stdout)
    assert len(losses) == 5 and all(loss == loss for loss in losses), run.stdout[-2000:]
    assert len(re.findall(r"max attention logit: ", run.stdout)) == 5
    assert "ZeRO all-gathers their weights in FP8" in run.stdout
