"""zero_to_fp32 for our checkpoints: TP2xPP2xDP2 ZeRO-1 and TP2xDP2 ZeRO-3 consolidate to the model's full fp32 weights."""
import json
import os
import struct
import subprocess
import sys

import pytest
import torch

from megatron_zero.checkpoint.consolidate import consolidate_fp32, get_fp32_state_dict
from megatron_zero.checkpoint.universal_convert import convert_to_universal
from megatron_zero.testing import run_ranks
from test_universal_checkpoint import full_weights, train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def read_safetensors(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        assert info["dtype"] == "F32"
        a, b = info["data_offsets"]
        out[name] = torch.frombuffer(bytearray(data[a:b]), dtype=torch.float32).view(info["shape"])
    return out


@pytest.mark.parametrize("tp,pp,dp,stage", [(2, 2, 2, 1), (2, 1, 2, 3)], ids=["tp2pp2dp2-zero1", "tp2dp2-zero3"])
def test_consolidate(tmp_path, tp, pp, dp, stage):
    results = run_ranks(train, tp * pp * dp, tp, pp, stage, 2, str(tmp_path), None, "universal", 3, 3, timeout=300)
    want = full_weights(results)  # gathered model weights after 3 steps == the fp32 masters in fp32 training
    assert want["tied_modules.embed.word_embeddings.weight"].shape == (100, 32)

    sd = get_fp32_state_dict(str(tmp_path))
    assert set(sd) == set(want)
    for name, w in want.items():
        assert torch.equal(sd[name], w), name

    out = tmp_path / "bin"
    consolidate_fp32(str(tmp_path), str(out), progress=False)
    loaded = torch.load(out / "pytorch_model.bin", weights_only=True)
    assert set(loaded) == set(want) and all(torch.equal(loaded[n], want[n]) for n in want)

    out = tmp_path / "st"
    info = consolidate_fp32(str(tmp_path), str(out), safe_serialization=True, max_shard_size=60_000, progress=False)
    index = json.load(open(out / "model.safetensors.index.json"))
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and info["files"][:-1] == shards
    assert index["metadata"]["total_size"] == sum(w.numel() * 4 for w in want.values())
    got = {}
    for shard in shards:
        part = read_safetensors(out / shard)
        assert sum(t.numel() * 4 for t in part.values()) <= 60_000 or len(part) == 1
        got.update(part)
    assert set(got) == set(want) and all(torch.equal(got[n], want[n]) for n in want)
    try:
        from safetensors.torch import load_file  # the reference reader, when installed
        for shard in shards:
            for name, t in load_file(out / shard).items():
                assert torch.equal(t, want[name]), name
    except ImportError:
        print("safetensors is not installed: checked with the format reader above only")

    # a universal checkpoint consolidates to the same weights
    uni = tmp_path / "global_step3_universal"
    convert_to_universal(str(tmp_path / "global_step3"), str(uni), progress=False)
    usd = get_fp32_state_dict(str(uni))
    assert set(usd) == set(want) and all(torch.equal(usd[n], want[n]) for n in want)


def test_zero_to_fp32_cli(tmp_path):
    run_ranks(train, 2, 1, 2, 1, 2, str(tmp_path), None, "universal", 2, 2, timeout=300)
    out = tmp_path / "out"
    done = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "zero_to_fp32.py"), str(tmp_path), str(out),
                           "--safe_serialization", "--quiet"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "wrote 52 parameters" in done.stdout and (out / "model.safetensors").exists()
    bad = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "zero_to_fp32.py"), str(tmp_path / "nope"),
                          str(out)], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "does not exist" in bad.stderr
