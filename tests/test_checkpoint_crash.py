"""A rank SIGKILLed at any point of a save leaves the previous checkpoint whole and `latest` consistent."""
import os

import pytest
import torch

from megatron_zero.checkpoint.storage.commit import read_latest
from megatron_zero.checkpoint.errors import CRASH_ENV, CRASH_RANK_ENV
from megatron_zero.checkpoint.storage.reader import open_checkpoint
from megatron_zero.checkpoint.storage.writer import CheckpointWriter
from megatron_zero.testing.multirank import RankFailure, run_ranks


def _state(rank, step):
    g = torch.Generator().manual_seed(100 * rank + step)
    return {"big": torch.randn(200_000, generator=g), "step": step}


def _save(save_dir, step, async_save=False):
    rank = torch.distributed.get_rank()
    writer = CheckpointWriter()
    writer.save(save_dir, f"global_step{step}", [(f"r{rank}.pt", _state(rank, step))], iteration=step,
                async_save=async_save, keep_last_k=2)
    writer.wait()
    return True


def _check_whole(save_dir):
    """Every file of the checkpoint `latest` names verifies and holds that step's state; return the step."""
    ckpt = open_checkpoint(save_dir)
    step = int(ckpt.tag.replace("global_step", ""))
    for rank in (0, 1):
        sd = ckpt.load(f"r{rank}.pt")
        assert sd["step"] == step and torch.equal(sd["big"], _state(rank, step)["big"])
    return step


# (crash point, which rank dies, is the new checkpoint named by `latest` afterwards)
POINTS = [("mid_file", 1, False), ("mid_file", 0, False), ("before_manifest", 0, False),
          ("before_rename", 0, False), ("before_latest", 0, False), ("after_latest", 0, True)]


def _crash_each(tmp_path, points):
    """Save step 1, then a save per point killed there (sync and async in turn), then one that succeeds."""
    save_dir = str(tmp_path / "ckpt")
    run_ranks(_save, 2, save_dir, 1, timeout=60)
    previous = 1
    for i, (point, rank, committed) in enumerate(points):
        step = 2 + i
        env = {CRASH_ENV: point, CRASH_RANK_ENV: str(rank)}
        with pytest.raises(RankFailure):  # the killed rank, or its peer losing it
            run_ranks(_save, 2, save_dir, step, i % 2 == 1, env=env, timeout=60)
        assert read_latest(save_dir) == f"global_step{step if committed else previous}", point
        assert _check_whole(save_dir) == (step if committed else previous), point
        previous = step if committed else previous
    # the next successful save cleans the debris of the crashed ones and is itself whole
    run_ranks(_save, 2, save_dir, 99, timeout=60)
    assert _check_whole(save_dir) == 99
    assert not [n for n in os.listdir(save_dir) if ".tmp-" in n or ".old-" in n]


def test_sigkill_during_save_keeps_previous_checkpoint(tmp_path):
    """A rank killed mid-file, before the directory's rename and after `latest` moved (sync, async, sync)."""
    _crash_each(tmp_path, [POINTS[0], POINTS[3], POINTS[5]])


@pytest.mark.slow  # default tier: test_sigkill_during_save_keeps_previous_checkpoint (three of these points)
def test_sigkill_at_every_point_of_a_save_keeps_previous_checkpoint(tmp_path):
    _crash_each(tmp_path, POINTS)
