"""zero_to_fp32 for our checkpoints: TP2xPP2xDP2 ZeRO-1 and TP2xDP2 ZeRO-3 consolidate to the model's full fp32 weights."""
import json
import os
import struct
import subprocess
import sys

import pytest
import torch

from megatron_zero.checkpoint.export.consolidate import consolidate_fp32, get_fp32_state_dict
from megatron_zero.checkpoint.reshape.universal_convert import convert_to_universal
from megatron_zero.testing import run_ranks
from megatron_zero.testing.layout_train import full_weights, train

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
    for mmap in (False, True):  # streamed one parameter at a time; a plain torch.load reads it
        loaded = torch.load(out / "pytorch_model.bin", weights_only=True, mmap=mmap)
        assert list(loaded) == list(sd) and all(torch.equal(loaded[n], want[n]) for n in want)

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
    consolidate_fp32(str(uni), str(tmp_path / "ubin"), progress=False)  # streamed from the mapped fp32.pt files
    ubin = torch.load(tmp_path / "ubin" / "pytorch_model.bin", weights_only=True, mmap=True)
    assert set(ubin) == set(want) and all(torch.equal(ubin[n], want[n]) for n in want)


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


def _zip_checks(path):
    import zipfile
    with zipfile.ZipFile(path) as z:
        infos = {i.filename: i for i in z.infolist()}
        raw = open(path, "rb").read()
        for name, i in infos.items():
            if name.startswith("archive/data/"):  # storage records start on 64-byte boundaries (mmap)
                n, e = struct.unpack("<HH", raw[i.header_offset + 26:i.header_offset + 30])
                assert (i.header_offset + 30 + n + e) % 64 == 0, name
        return z.read("archive/data.pkl")


@pytest.mark.parametrize("zip64", [False, True], ids=["zip", "zip64"])
def test_torch_zip_writer(tmp_path, zip64):
    from megatron_zero.checkpoint.storage.torch_zip_writer import TorchZipWriter
    g = torch.Generator().manual_seed(0)
    sd = {"w": torch.randn(5, 7, generator=g), "b16": torch.randn(3, generator=g).bfloat16(),
          "ids": torch.arange(6).view(2, 3), "scalar": torch.tensor(2.5), "empty": torch.empty(0, 4),
          "t": torch.randn(4, 6, generator=g).t(), "half": torch.randn(9, generator=g).half()[2:5]}
    path = tmp_path / "streamed.bin"
    with TorchZipWriter(str(path), force_zip64=zip64) as w:
        for name, t in sd.items():
            w.add(name, t)
    for mmap in (False, True):
        got = torch.load(path, weights_only=True, mmap=mmap)
        assert list(got) == list(sd)
        for name, t in sd.items():
            assert got[name].dtype == t.dtype and got[name].shape == t.shape and torch.equal(got[name], t), name
    torch.save({k: v.contiguous().clone() for k, v in sd.items()}, tmp_path / "archive.pt")
    import zipfile
    with zipfile.ZipFile(tmp_path / "archive.pt") as z:  # the same pickle torch.save writes
        assert _zip_checks(path) == z.read("archive/data.pkl")


def test_torch_zip_writer_copies_mapped_files(tmp_path):
    """Views of memory-mapped files are copied file-to-file; files mapped in turn at reused addresses stay apart."""
    from megatron_zero.checkpoint.storage.torch_zip_writer import TorchZipWriter
    want = {}
    with TorchZipWriter(str(tmp_path / "out.bin"), copy_files=True) as w:
        for k in range(3):  # same-sized files, each unmapped before the next is mapped
            torch.save({"flat": torch.full((300_000,), float(k)) + torch.arange(300_000)}, tmp_path / f"{k}.pt")
            flat = torch.load(tmp_path / f"{k}.pt", mmap=True, weights_only=True)["flat"]
            for name, view in ((f"a{k}", flat[1000:5000].view(40, 100)), (f"b{k}", flat[123:124567])):
                want[name] = view.clone()
                w.add(name, view)
            del flat, view
    got = torch.load(tmp_path / "out.bin", weights_only=True, mmap=True)
    assert list(got) == list(want) and all(torch.equal(got[n], want[n]) for n in want)
    _zip_checks(tmp_path / "out.bin")


BOUNDED = r"""
import sys, torch
from megatron_zero.checkpoint.storage.torch_zip_writer import TorchZipWriter
def hwm():
    return int([l for l in open("/proc/self/status") if l.startswith("VmHWM")][0].split()[1]) * 1024
def rss():
    return int([l for l in open("/proc/self/status") if l.startswith("VmRSS")][0].split()[1]) * 1024
x = torch.full((1 << 21,), 1.0); del x  # allocator warm-up
base = rss()
open("/proc/self/clear_refs", "w").write("5")  # reset VmHWM to the current RSS
with TorchZipWriter(sys.argv[1]) as w:
    for i in range(32):  # 32 tensors x 8 MiB = 256 MiB, made one at a time
        w.add(f"p{i}", torch.full((1 << 21,), float(i)))
print(hwm() - base)
"""


def test_streamed_bin_memory_is_one_tensor(tmp_path):
    out = tmp_path / "big.bin"
    done = subprocess.run([sys.executable, "-c", BOUNDED, str(out)], capture_output=True, text=True, timeout=120,
                          cwd=ROOT)
    assert done.returncode == 0, done.stderr
    extra = int(done.stdout.split()[-1])
    assert extra < 48 << 20, f"peak RSS grew {extra / 2**20:.0f} MiB while streaming 256 MiB"
    got = torch.load(out, weights_only=True, mmap=True)
    assert len(got) == 32 and all(torch.equal(got[f"p{i}"], torch.full((1 << 21,), float(i))) for i in (0, 17, 31))


@pytest.mark.parametrize("reserve_for", ["all", "none"], ids=["header-in-reserved-room", "header-moved"])
def test_safetensors_stream(tmp_path, reserve_for):
    from megatron_zero.checkpoint.export.consolidate import SafetensorsStream
    sd = {f"layer.{i}.weight": torch.randn(3, i + 1, 2) for i in range(6)}
    sd["bias"] = torch.arange(5.0).bfloat16()
    path = str(tmp_path / "x.safetensors")
    w = SafetensorsStream(path, list(sd) if reserve_for == "all" else [])
    for name, t in sd.items():
        w.add(name, t)
    w.close()
    got = read_safetensors_any(path)
    assert list(got) == list(sd) and all(torch.equal(got[n], sd[n]) for n in sd)


def read_safetensors_any(path):
    from safetensors.torch import load_file
    return load_file(path)


def test_torch_zip_writer_removes_partial_file(tmp_path):
    from megatron_zero.checkpoint.storage.torch_zip_writer import TorchZipWriter
    path = tmp_path / "x.bin"
    with pytest.raises(ValueError, match="already written"):
        with TorchZipWriter(str(path)) as w:
            w.add("a", torch.ones(3))
            w.add("a", torch.ones(3))
    assert not path.exists()


def test_storage_type_table_matches_torch():
    """The public storage-class table torch_zip_writer pickles by equals torch's own (private) mapping."""
    from megatron_zero.checkpoint.storage.torch_zip_writer import STORAGE_TYPES
    for dtype, name in STORAGE_TYPES.items():
        assert torch.storage.TypedStorage(dtype=dtype, device="cpu", _internal=True)._pickle_storage_type() == name
