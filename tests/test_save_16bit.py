"""The 16-bit model written with each save: every rank streams its run of parameters; the shards plus
Hugging Face's index hold exactly the consolidated fp32 weights cast to bf16 (bit for bit), readable by
the safetensors library; tools/zero_to_fp32.py --dtype bf16 writes the same offline."""
import json
import os
import subprocess
import sys

import pytest
import torch

from megatron_zero.arguments import parse_args
from megatron_zero.checkpoint.export.consolidate import load_consolidated
from megatron_zero.checkpoint.export.save_16bit import DIRNAME, INDEX, save_16bit_model, shard_names, split_by_bytes
from megatron_zero.testing import run_ranks
from megatron_zero.testing.launch import model_flags
from megatron_zero.testing.layout_train import full_weights, train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_split_by_bytes_is_contiguous_and_balanced():
    sizes = [5, 1, 1, 1, 8, 2, 2, 4]
    parts = split_by_bytes(sizes, 3)
    assert [i for r in parts for i in r] == list(range(len(sizes)))
    assert max(sum(sizes[i] for i in r) for r in parts) <= sum(sizes) / 3 + max(sizes)
    assert split_by_bytes([7], 3) == [range(0, 1), range(1, 1), range(1, 1)]
    assert shard_names(split_by_bytes([7], 3)) == ["model.safetensors", "", ""]
    assert shard_names([range(0, 2), range(2, 3)]) == ["model-00001-of-00002.safetensors",
                                                     "model-00002-of-00002.safetensors"]


def _train_save_16bit(save_dir):
    out = train(2, 2, 1, 2, save_dir, iters=1, save_at=1)
    save_16bit_model(os.path.join(save_dir, "global_step1"), torch.bfloat16)
    return out


def test_each_rank_writes_its_shard_tp2_pp2(tmp_path):
    results = run_ranks(_train_save_16bit, 4, str(tmp_path), timeout=300)
    want = {n: t.to(torch.bfloat16) for n, t in full_weights(results).items()}
    out = tmp_path / "global_step1" / DIRNAME
    with open(out / INDEX) as f:
        weight_map = json.load(f)["weight_map"]
    shards = sorted(set(weight_map.values()))
    assert shards == [f"model-{k:05d}-of-00004.safetensors" for k in range(1, 5)]  # one per rank
    assert not list(out.glob("*.part"))
    safetensors = pytest.importorskip("safetensors.torch")
    got = {}
    for shard in shards:
        got.update(safetensors.load_file(str(out / shard)))
    assert sorted(got) == sorted(want) == sorted(weight_map)
    for name, t in want.items():
        assert got[name].dtype == torch.bfloat16 and torch.equal(got[name], t), name
    # offline, the same bytes from the checkpoint
    run = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "zero_to_fp32.py"), str(tmp_path),
                          str(tmp_path / "offline"), "--safe_serialization", "--dtype", "bf16", "--quiet"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    offline = load_consolidated(str(tmp_path / "offline"))
    assert all(torch.equal(offline[n], t) for n, t in want.items()) and len(offline) == len(want)


def test_deepspeed_key_and_flag(tmp_path):
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps({"zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": True}}))
    assert parse_args(model_flags("d", "t", **{"deepspeed-config": cfg})).save_16bit_model is True
    assert parse_args(model_flags("d", "t", **{"save-16bit-model": True})).save_16bit_model is True
    assert parse_args(model_flags("d", "t")).save_16bit_model is False
