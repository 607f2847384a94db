"""Exact resume: train 8 iterations, or 4 + save + resume + 4; iterations 5-8 are bit-identical.

Drives the real Trainer (pipeline schedule, ZeRO optimizer, LR schedule, data sampler, dropout RNG)
on gloo ranks; dropout is on, so the RNG states must come back too.
"""
import os

import pytest

from megatron_zero.testing.multirank import run_ranks
from megatron_zero.testing.trainer_losses import resume_flags, train_losses

ITERS, SAVE_AT = 8, 4


@pytest.mark.parametrize("tp,pp,world,zero,async_save", [
    pytest.param(2, 2, 8, 1, False, marks=pytest.mark.slow),  # ZeRO-1's resume: also tests/test_cli_resume.py
    (2, 2, 8, 2, True),
    (1, 1, 4, 3, False),
])
def test_resume_is_bit_identical(builtin_corpus, tmp_path, tp, pp, world, zero, async_save):
    iters = {"train-iters": ITERS}
    whole = run_ranks(train_losses, world, resume_flags(builtin_corpus, tmp_path, tp, pp, zero, **iters), tp, pp,
                      timeout=600)[0]
    save = str(tmp_path / "ckpt")
    extra = {**iters, "save": save, "save-interval": SAVE_AT, "exit-interval": SAVE_AT, "async-save": async_save}
    first = run_ranks(train_losses, world, resume_flags(builtin_corpus, tmp_path, tp, pp, zero, **extra), tp, pp,
                      timeout=600)[0]
    assert open(os.path.join(save, "latest")).read() == f"global_step{SAVE_AT}"
    files = sorted(os.listdir(os.path.join(save, f"global_step{SAVE_AT}")))
    assert f"zero_pp_rank_{world // (tp * pp) - 1}_mp_rank_{tp * pp - 1:02d}_optim_states.pt" in files
    assert "zero_to_fp32.py" in files and "manifest.json" in files
    resumed = run_ranks(train_losses, world, resume_flags(builtin_corpus, tmp_path, tp, pp, zero, load=save, **iters),
                        tp, pp, timeout=600)[0]
    assert len(whole) == ITERS and len(first) == SAVE_AT and len(resumed) == ITERS - SAVE_AT
    assert first == whole[:SAVE_AT]
    assert resumed == whole[SAVE_AT:], [a - b for a, b in zip(resumed, whole[SAVE_AT:])]
