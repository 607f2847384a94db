"""Weights-only checkpoints (--no-save-optim, --no-save-rng, --save-weights-interval) through pretrain_gpt.py and tools/.

A weights-only save keeps the model files and the fp32 master partitions, in the same committed,
checksummed layout, and drops Adam's moments, step and loss scale. --load of one trains from those
weights at iteration 0 with a fresh optimizer, and says so; that is exactly --finetune from the full
checkpoint saved at the same iteration (same fp32 masters, same fresh optimizer, same data from sample
0), so the two runs' losses must be bit-identical on one process. ds_to_universal and zero_to_fp32 read
it; zero_to_fp32 gives the full checkpoint's weights bit for bit.
"""
import os
import re
import subprocess
import sys

import pytest
import torch

from megatron_zero.testing.launch import ROOT, byte_data, losses_from_log, pretrain


def _size(directory):
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(directory) for f in files)


def _ok(run):
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    return run


def _optim_file(tag_dir):
    return torch.load(os.path.join(tag_dir, [f for f in os.listdir(tag_dir) if f.endswith("optim_states.pt")][0]),
                      weights_only=False)


@pytest.mark.slow  # five pretrain_gpt.py runs and two tools: about two minutes
def test_weights_only_save_load_and_tools(tmp_path):
    data = byte_data(tmp_path / "bytes")
    common = {"train-iters": 3, "hidden-size": 64, "seq-length": 32}
    _ok(pretrain(tmp_path, data, save=tmp_path / "full", **common))
    _ok(pretrain(tmp_path, data, save=tmp_path / "light", **common, **{"no-save-optim": True, "no-save-rng": True}))
    full, light = tmp_path / "full" / "global_step3", tmp_path / "light" / "global_step3"

    osd = _optim_file(light)["optimizer_state_dict"]
    assert osd["base_optimizer_state"]["state"] == {} and osd["loss_scaler"] is None
    masters = osd["single_partition_of_fp32_groups"]
    full_masters = _optim_file(full)["optimizer_state_dict"]["single_partition_of_fp32_groups"]
    assert all(torch.equal(a, b) for a, b in zip(masters, full_masters))
    states = torch.load(light / "mp_rank_00_model_states.pt", weights_only=False)
    assert states["weights_only"] is True and states["rng_state"] == [None]
    # the two Adam moments (fp32, one per master element) are what the light save leaves out
    moments = 2 * 4 * sum(m.numel() for m in masters)
    saved = _size(full) - _size(light)
    assert moments <= saved <= moments + 64 * 1024, (saved, moments)

    # --load of the weights-only checkpoint == --finetune from the full one, bit for bit
    resumed = _ok(pretrain(tmp_path, data, save=tmp_path / "from_light", load=tmp_path / "light", **common))
    assert "holds weights only: training starts from them at iteration 0 with a fresh optimizer" in resumed.stdout
    assert "from iteration 0 " in resumed.stdout
    finetuned = _ok(pretrain(tmp_path, data, save=tmp_path / "from_full", load=tmp_path / "full", finetune=True,
                             **common))
    assert losses_from_log(resumed.stdout) == losses_from_log(finetuned.stdout) != []

    # the tools take it
    universal = tmp_path / "universal"
    _ok(subprocess.run([sys.executable, os.path.join(ROOT, "tools", "ds_to_universal.py"), "--input_folder",
                        str(light), "--output_folder", str(universal)], capture_output=True, text=True))
    params = [d for d in os.listdir(universal / "zero") if os.path.isdir(universal / "zero" / d)]
    assert params and all(os.listdir(universal / "zero" / d) == ["fp32.pt"] for d in params)
    out = {}
    for name, src in (("light", light), ("full", full)):
        _ok(subprocess.run([sys.executable, os.path.join(ROOT, "tools", "zero_to_fp32.py"), str(src),
                            str(tmp_path / f"fp32_{name}")], capture_output=True, text=True))
        files = os.listdir(tmp_path / f"fp32_{name}")
        out[name] = torch.load(tmp_path / f"fp32_{name}" / [f for f in files if f.endswith(".bin")][0])
    assert out["light"].keys() == out["full"].keys()
    assert all(torch.equal(out["light"][k], out["full"][k]) for k in out["full"])
    # the universal one loads too: weights at iteration 0 again
    again = _ok(pretrain(tmp_path, data, save=tmp_path / "from_universal", load=universal,
                         **{**common, "universal-checkpoint": True}))
    assert "holds weights only" in again.stdout


def test_save_weights_interval_beside_full_saves(tmp_path):
    data = byte_data(tmp_path / "bytes")
    run = _ok(pretrain(tmp_path, data, **{"train-iters": 5, "save-interval": 2, "save-weights-interval": 1}))
    ckpt = tmp_path / "ckpt"
    full = sorted(d for d in os.listdir(ckpt) if d.startswith("global_step"))
    light = sorted(d for d in os.listdir(ckpt / "weights_only") if d.startswith("global_step"))
    assert full == ["global_step2", "global_step4", "global_step5"]
    assert light == ["global_step1", "global_step3", "global_step5"]
    assert (ckpt / "latest").read_text().strip() == "global_step5"
    assert (ckpt / "weights_only" / "latest").read_text().strip() == "global_step5"
    light_osd = _optim_file(ckpt / "weights_only" / "global_step3")["optimizer_state_dict"]
    full_osd = _optim_file(ckpt / "global_step4")["optimizer_state_dict"]
    assert light_osd["base_optimizer_state"]["state"] == {} and full_osd["base_optimizer_state"]["state"] != {}
    saved = re.findall(r"^saved (checkpoint|weights-only checkpoint) (\S+) in [0-9.]+ s \((.*)\)$", run.stdout, re.M)
    assert [(what, os.path.relpath(path, ckpt)) for what, path, _ in saved] == [
        ("weights-only checkpoint", "weights_only/global_step1"), ("checkpoint", "global_step2"),
        ("weights-only checkpoint", "weights_only/global_step3"), ("checkpoint", "global_step4"),
        ("weights-only checkpoint", "weights_only/global_step5"), ("checkpoint", "global_step5")], run.stdout
    assert all(note.endswith("; no optimizer state: a --load of it starts a fresh optimizer at iteration 0")
               == (what != "checkpoint") for what, _, note in saved), saved
