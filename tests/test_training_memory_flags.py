"""Recomputation, the attention backend and sequence parallelism are invisible to checkpoints.

The real Trainer on TP2 x PP2: 6 iterations without the flags, against 2 with them (saved),
2 resumed without them (saved), 2 resumed with them again. fp32, dropout 0: every iteration's
loss matches the uninterrupted run to relative 1e-5 (the flags change rounding only).
"""
import pytest

from megatron_zero.testing.multirank import run_ranks
from megatron_zero.testing.trainer_losses import resume_flags, train_losses

MEMORY_FLAGS = {"sequence-parallel": True, "recompute-granularity": "full", "recompute-method": "uniform",
                "recompute-num-layers": 1, "attention-backend": "flash"}


def test_checkpoint_resumes_with_and_without_the_flags(builtin_corpus, tmp_path):
    def run(extra):
        flags = resume_flags(builtin_corpus, tmp_path, 2, 2, 1, **{"train-iters": 6, "global-batch-size": 4,
                                                              "hidden-dropout": 0.0, "attention-dropout": 0.0, **extra})
        return run_ranks(train_losses, 4, flags, 2, 2, timeout=600)[0]

    whole = run({"attention-backend": "unfused"})
    save = str(tmp_path / "ckpt")
    keep = {"save": save, "save-interval": 2}
    with_flags = run({**keep, **MEMORY_FLAGS, "exit-interval": 2})
    without = run({**keep, "load": save, "exit-interval": 4})
    again = run({**keep, **MEMORY_FLAGS, "load": save})
    assert len(with_flags) == len(without) == len(again) == 2
    assert with_flags + without + again == pytest.approx(whole, rel=1e-5)
