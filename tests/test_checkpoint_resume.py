"""Exact resume: train 20 iterations, or 10 + save + resume + 10; iterations 11-20 are bit-identical.

Drives the real Trainer (pipeline schedule, ZeRO optimizer, LR schedule, data sampler, dropout RNG)
on gloo ranks; dropout is on, so the RNG states must come back too.
"""
import os

import pytest

from megatron_zero.testing.multirank import run_ranks
from megatron_zero.testing.trainer_losses import resume_flags, train_losses


@pytest.mark.parametrize("tp,pp,world,zero,async_save", [
    (2, 2, 8, 1, False),
    (2, 2, 8, 2, True),
    (1, 1, 4, 3, False),
])
def test_resume_is_bit_identical(builtin_corpus, tmp_path, tp, pp, world, zero, async_save):
    whole = run_ranks(train_losses, world, resume_flags(builtin_corpus, tmp_path, tp, pp, zero), tp, pp, timeout=600)[0]
    save = str(tmp_path / "ckpt")
    extra = {"save": save, "save-interval": 10, "exit-interval": 10, "async-save": async_save}
    first = run_ranks(train_losses, world, resume_flags(builtin_corpus, tmp_path, tp, pp, zero, **extra), tp, pp,
                      timeout=600)[0]
    assert open(os.path.join(save, "latest")).read() == "global_step10"
    files = sorted(os.listdir(os.path.join(save, "global_step10")))
    assert f"zero_pp_rank_{world // (tp * pp) - 1}_mp_rank_{tp * pp - 1:02d}_optim_states.pt" in files
    assert "zero_to_fp32.py" in files and "manifest.json" in files
    resumed = run_ranks(train_losses, world, resume_flags(builtin_corpus, tmp_path, tp, pp, zero, load=save), tp, pp,
                        timeout=600)[0]
    assert len(whole) == 20 and len(first) == 10 and len(resumed) == 10
    assert first == whole[:10]
    assert resumed == whole[10:], [a - b for a, b in zip(resumed, whole[10:])]
