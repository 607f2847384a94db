"""--rampup-batch-size through pretrain_gpt.py on two data-parallel ranks: the log shows each iteration's global
batch (Megatron's ramp), a checkpoint is taken where the batch grows (as Megatron-LM does), and a run stopped
mid-ramp and resumed from its checkpoint ends with the same weights and optimizer state, bit for bit, as the
run that never stopped (the batch it continues at comes from the consumed samples the checkpoint saved)."""
import os
import re

import pytest
import torch

from megatron_zero.testing.launch import byte_data, losses_from_log, tiny_flags, torchrun

RAMP = ["--rampup-batch-size", "2", "2", "12"]  # to --global-batch-size 8 over 12 samples: 2, 2, 4, 6, 8, 8, 8
SIZES = [2, 2, 4, 6, 8, 8, 8]


def _argv(tmp_path, data, save, **changes):
    flags = {"micro-batch-size": 1, "global-batch-size": 8, "train-iters": None, "train-samples": 38,
             "lr-warmup-samples": 6, "lr-decay-samples": 38, "lr-decay-style": "cosine", "save": save,
             "save-interval": 100, **changes}
    return tiny_flags(tmp_path, data, **flags) + RAMP


def _tensors(directory):
    """Every tensor of a checkpoint's files, by file and key path."""
    found = {}

    def walk(prefix, value):
        if isinstance(value, torch.Tensor):
            found[prefix] = value
        elif isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}/{k}", v)
        elif isinstance(value, (list, tuple)):
            for k, v in enumerate(value):
                walk(f"{prefix}/{k}", v)

    for name in sorted(os.listdir(directory)):
        if name.endswith(".pt"):
            walk(name, torch.load(os.path.join(directory, name), map_location="cpu", weights_only=False))
    return found


@pytest.mark.slow
def test_rampup_train_and_resume_mid_ramp(tmp_path):
    data = byte_data(tmp_path / "bytes")
    whole_dir, split_dir = str(tmp_path / "whole"), str(tmp_path / "split")
    whole = torchrun(2, _argv(tmp_path, data, whole_dir))
    assert whole.returncode == 0, whole.stderr[-3000:]
    assert [int(x) for x in re.findall(r"global batch size: +(\d+)", whole.stdout)] == SIZES
    assert re.findall(r"consumed samples: +(\d+)", whole.stdout)[-1] == str(sum(SIZES))
    assert "the global batch grows to 4 (2 micro-batches per step) at iteration 2" in whole.stdout
    assert {"global_step2", "global_step3", "global_step4", "global_step7"} <= set(os.listdir(whole_dir))

    first = torchrun(2, _argv(tmp_path, data, split_dir, **{"exit-interval": 3}))  # stops with the batch at 6 next
    assert first.returncode == 0, first.stderr[-3000:]
    resumed = torchrun(2, _argv(tmp_path, data, split_dir, load=split_dir))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "from iteration 3 (8 samples consumed), 3 micro-batches per step (global batch 6" in resumed.stdout
    assert [int(x) for x in re.findall(r"global batch size: +(\d+)", resumed.stdout)] == SIZES[3:]
    assert losses_from_log(first.stdout) + losses_from_log(resumed.stdout) == losses_from_log(whole.stdout)
    want, got = _tensors(os.path.join(whole_dir, "global_step7")), _tensors(os.path.join(split_dir, "global_step7"))
    assert want.keys() == got.keys() and len(want) > 10
    different = [k for k in want if not torch.equal(want[k], got[k])]
    assert not different, different
