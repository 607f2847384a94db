"""Loads of a checkpoint without a recorded layout at another DP size than the saver's, through pretrain_gpt.py.

A checkpoint records its layout in its manifest; one without (as DeepSpeed writes it), or one opened with
--no-verify-checkpoint (which reads no manifest), shows it in its header and files instead
(checkpoint/shown_layout.py). Loaded weights-only (--no-load-optim, --finetune) at another DP size, the run's ZeRO
masters must come from the loaded weights: kept at their initial values, the first step would write the initial
weights back over the loaded ones, and the second step's loss would be an untrained model's. So each load at
another DP logs what the same load at the saver's layout logs, and a full resume what the uninterrupted run
logged: fp32, dropout 0, the DP reduction order the only difference (relative 1e-5, test_cli_resume.py's bound
for another layout; a lost master or moment moves these losses by more than 1e-3).
"""
import os

import pytest

from megatron_zero.checkpoint.storage.manifest import MANIFEST
from megatron_zero.testing.cli import cli_flags, layout_flags, logged_losses, pretrain_cli, text_data

pytestmark = pytest.mark.multirank

ANOTHER_LAYOUT_REL = 1e-5


def _saved(tmp_path, zero: int, manifest: bool = False) -> tuple:
    """(data, the save directory, the uninterrupted run's losses): 4 iterations at DP2 ZeRO-`zero` saving at 2 and
    4; global_step2 without its manifest (no recorded layout, as DeepSpeed writes it) unless `manifest`."""
    data = text_data(tmp_path / "text")
    save = str(tmp_path / "ckpt")
    whole = _losses(tmp_path, data, 2, layout_flags(zero=zero), {"train-iters": 4, "save": save, "save-interval": 2})
    if not manifest:
        os.remove(os.path.join(save, "global_step2", MANIFEST))
    return data, save, whole


def _losses(tmp_path, data, nproc: int, *changes) -> dict:
    return logged_losses(pretrain_cli(nproc, cli_flags(data, str(tmp_path / "cache"), "gpt2", *changes)))


def _load(save, zero: int, **flags) -> dict:
    return {"load": save, "ckpt-step": 2, "train-iters": 4, **layout_flags(zero=zero), **flags}


def test_loads_at_another_dp_of_a_zero3_checkpoint_without_its_layout(tmp_path):
    """ZeRO-3 holds the weights only in its DP-partitioned files: weights-only and full loads at DP1 reshape them."""
    data, save, whole = _saved(tmp_path, zero=3)
    at_saver_dp = _losses(tmp_path, data, 2, _load(save, 3, **{"no-load-optim": True}))
    at_one_rank = _losses(tmp_path, data, 1, _load(save, 3, **{"no-load-optim": True}))
    assert sorted(at_one_rank) == [3, 4]
    # iteration 3 runs on the loaded weights; iteration 4 on what the first step wrote from the masters
    assert at_one_rank == pytest.approx(at_saver_dp, rel=ANOTHER_LAYOUT_REL), (at_one_rank, at_saver_dp)
    resumed = _losses(tmp_path, data, 1, _load(save, 3))  # the optimizer too: the uninterrupted run's losses
    assert resumed == pytest.approx({i: whole[i] for i in (3, 4)}, rel=ANOTHER_LAYOUT_REL), (resumed, whole)


@pytest.mark.slow  # covered in the default tier by the ZeRO-3 loads above (the same choice of loader)
def test_finetune_and_unverified_loads_at_another_dp(tmp_path):
    """--finetune of a ZeRO-1 checkpoint without its manifest, and a resume at another DP with
    --no-verify-checkpoint, which reads no manifest, of one that has it."""
    data, save, whole = _saved(tmp_path, zero=1, manifest=True)
    resumed = _losses(tmp_path, data, 1, _load(save, 1, **{"no-verify-checkpoint": True}))
    assert resumed == pytest.approx({i: whole[i] for i in (3, 4)}, rel=ANOTHER_LAYOUT_REL), (resumed, whole)
    os.remove(os.path.join(save, "global_step2", MANIFEST))
    finetune = _load(save, 1, finetune=True, **{"train-iters": 2})
    at_saver_dp, at_one_rank = _losses(tmp_path, data, 2, finetune), _losses(tmp_path, data, 1, finetune)
    assert sorted(at_one_rank) == [1, 2]  # --finetune: iteration 0, a fresh optimizer
    assert at_one_rank == pytest.approx(at_saver_dp, rel=ANOTHER_LAYOUT_REL), (at_one_rank, at_saver_dp)


@pytest.mark.slow  # 4 ranks; covered in the default tier by the DP2 -> DP1 loads of ZeRO-3 above
@pytest.mark.parametrize("zero", [1, 2, 3])
def test_weights_only_load_at_dp4(tmp_path, zero):
    data, save, _ = _saved(tmp_path, zero=zero)
    load = _load(save, zero, **{"no-load-optim": True})
    at_saver_dp, at_four_ranks = _losses(tmp_path, data, 2, load), _losses(tmp_path, data, 4, load)
    assert sorted(at_four_ranks) == [3, 4]
    assert at_four_ranks == pytest.approx(at_saver_dp, rel=ANOTHER_LAYOUT_REL), (at_four_ranks, at_saver_dp)
