"""A weights-only load (--no-load-optim) of a checkpoint without a saved layout (as DeepSpeed writes it: no
manifest) at another DP size than the saver's: the ZeRO masters come from the loaded weights, so the run
continues from them exactly as the same load at the saver's DP does (fp32, dropout 0: the losses to 1e-6
relative, the DP reduction order the only difference)."""
import os

import pytest

from megatron_zero.checkpoint.storage.manifest import MANIFEST
from megatron_zero.testing.cli import cli_flags, logged_losses, pretrain_cli, text_data


def test_weights_only_load_at_another_dp_continues_from_the_loaded_weights(tmp_path):
    data = text_data(tmp_path / "text")
    save = str(tmp_path / "ckpt")
    pretrain_cli(2, cli_flags(data, str(tmp_path / "cache"), "gpt2", {"train-iters": 2, "save": save,
                                                                         "save-interval": 2}))
    os.remove(os.path.join(save, "global_step2", MANIFEST))  # no saved layout, as a DeepSpeed-written one
    load = {"load": save, "no-load-optim": True, "train-iters": 4}
    at_saver_dp = logged_losses(pretrain_cli(2, cli_flags(data, str(tmp_path / "cache"), "gpt2", load)))
    at_one_rank = logged_losses(pretrain_cli(1, cli_flags(data, str(tmp_path / "cache"), "gpt2", load)))
    assert sorted(at_one_rank) == [3, 4]
    # iteration 3 runs on the loaded weights either way; iteration 4 on what the first step wrote back
    assert at_one_rank == pytest.approx(at_saver_dp, rel=1e-6), (at_one_rank, at_saver_dp)
