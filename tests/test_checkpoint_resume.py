"""Exact resume: train 20 iterations, or 10 + save + resume + 10; iterations 11-20 are bit-identical.

Drives the real Trainer (pipeline schedule, ZeRO optimizer, LR schedule, data sampler, dropout RNG)
on gloo ranks; dropout is on, so the RNG states must come back too.
"""
import os

import pytest
import torch.distributed as dist

from megatron_zero.testing.multirank import run_ranks
from megatron_zero.testing.launch import model_flags


def _train(argv, tp, pp):
    from megatron_zero.arguments import parse_args
    from megatron_zero.topology import build_parallel_state
    from megatron_zero.training import Trainer

    args = parse_args(argv, world_size=dist.get_world_size())
    trainer = Trainer(args, build_parallel_state(tp, pp))
    losses = []
    step = trainer.train_step

    def recording_step(micro):
        out = step(micro)
        losses.append(float(out[0]))
        return out

    trainer.train_step = recording_step
    trainer.train()
    return losses


def _flags(corpus, tmp_path, tp, pp, zero, **extra):
    data, tok = corpus
    flags = {"tensor-model-parallel-size": tp, "pipeline-model-parallel-size": pp, "zero-stage": zero,
             "num-layers": 2, "hidden-size": 32, "num-attention-heads": 4, "seq-length": 32,
             "micro-batch-size": 1, "global-batch-size": 8, "train-iters": 20, "eval-iters": 0,
             "hidden-dropout": 0.1, "attention-dropout": 0.1, "data-cache-path": tmp_path / "cache",
             "log-interval": 100}
    flags.update(extra)
    return model_flags(data, tok, **flags)


@pytest.mark.parametrize("tp,pp,world,zero,async_save", [
    (2, 2, 8, 1, False),
    (2, 2, 8, 2, True),
    (1, 1, 4, 3, False),
])
def test_resume_is_bit_identical(builtin_corpus, tmp_path, tp, pp, world, zero, async_save):
    whole = run_ranks(_train, world, _flags(builtin_corpus, tmp_path, tp, pp, zero), tp, pp, timeout=600)[0]
    save = str(tmp_path / "ckpt")
    extra = {"save": save, "save-interval": 10, "exit-interval": 10, "async-save": async_save}
    first = run_ranks(_train, world, _flags(builtin_corpus, tmp_path, tp, pp, zero, **extra), tp, pp,
                      timeout=600)[0]
    assert open(os.path.join(save, "latest")).read() == "global_step10"
    files = sorted(os.listdir(os.path.join(save, "global_step10")))
    assert f"zero_pp_rank_{world // (tp * pp) - 1}_mp_rank_{tp * pp - 1:02d}_optim_states.pt" in files
    assert "zero_to_fp32.py" in files and "manifest.json" in files
    resumed = run_ranks(_train, world, _flags(builtin_corpus, tmp_path, tp, pp, zero, load=save), tp, pp,
                        timeout=600)[0]
    assert len(whole) == 20 and len(first) == 10 and len(resumed) == 10
    assert first == whole[:10]
    assert resumed == whole[10:], [a - b for a, b in zip(resumed, whole[10:])]
