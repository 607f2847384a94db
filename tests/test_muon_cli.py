"""pretrain_gpt.py with --optimizer dist_muon and Megatron-LM's Muon flags, as a user runs it: a toy trains and
saves, with QK-clip logging its max attention logit; a resume switching optimizer (AdamW checkpoint -> Muon run,
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


def test_dist_muon_trains_and_switching_optimizer_on_resume_starts_it_fresh(tmp_path, data):
    adam = losses_from_log(_run(tmp_path / "adam", data).stdout)
    clipped = _run(tmp_path / "muon", data, **MUON, **{"qk-clip": True, "qk-clip-threshold": 0.5})
    muon = losses_from_log(clipped.stdout)
    assert len(re.findall(r"\| max attention logit: [0-9.]+E[+-]\d+ \|", clipped.stdout)) == 4  # --log-interval 1
    assert len(muon) == 4 and muon[0] == adam[0] and muon[1] != adam[1]  # the same model, another step
    saved = tmp_path / "adam" / "ckpt" / "global_step2"
    switched = _run(tmp_path / "switched", data, load=saved, **MUON)
    assert (f"the checkpoint {saved} was trained with --optimizer adamw and this run uses --optimizer dist_muon: "
            "its weights load, the optimizer starts fresh") in switched.stdout
    # iterations 3 and 4 from the checkpoint's weights: iteration 3's loss (before its step) is AdamW's
    resumed = losses_from_log(switched.stdout)
    assert len(resumed) == 2 and resumed[0] == adam[2] and resumed[1] != adam[3]
    back = _run(tmp_path / "back", data, load=tmp_path / "switched" / "ckpt", **{"train-iters": 6})
    assert ("was trained with --optimizer dist_muon and this run uses --optimizer adamw: its weights load, the "
            "optimizer starts fresh") in back.stdout
    assert len(losses_from_log(back.stdout)) == 2
