"""The zero_to_fp32.py copied into every checkpoint takes DeepSpeed's command line.

A checkpoint saved by pretrain_gpt.py; the copy run as users run DeepSpeed's, in a fresh interpreter without
megatron_zero on the path: `checkpoint_dir output_dir` (pytorch_model.bin), `-t TAG --safe_serialization
--dtype bf16 --quiet` (model.safetensors, bf16, silent), `--max_shard_size` (Hugging Face's shard names and
index), and the older `checkpoint_dir output.pt`; each gives the package's consolidated weights. It needs
only torch: safetensors is imported for --safe_serialization alone, and its absence is one sentence.
"""
import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from megatron_zero.checkpoint.export.consolidate import get_fp32_state_dict, load_consolidated
from megatron_zero.testing.launch import byte_data, pretrain

pytestmark = pytest.mark.multirank  # launches pretrain_gpt.py
NO_SAFETENSORS = "import sys; sys.modules['safetensors'] = None; sys.modules['safetensors.torch'] = None; "


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("run")
    run = pretrain(tmp, byte_data(tmp / "bytes"), **{"zero-stage": 2})
    assert run.returncode == 0, run.stderr
    ckpt = tmp / "ckpt"
    return ckpt, get_fp32_state_dict(str(ckpt / "global_step2"))


def _run(ckpt, *argv, prelude=""):
    script = os.path.join(ckpt, "global_step2", "zero_to_fp32.py")
    code = prelude + f"import runpy, sys; sys.argv = {[script, *map(str, argv)]!r}; " \
        f"runpy.run_path({script!r}, run_name='__main__')"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env,
                          cwd=os.path.dirname(script))


def _same(got, want, dtype=torch.float32):
    return sorted(got) == sorted(want) and all(torch.equal(got[k], want[k].to(dtype)) for k in want)


def test_output_directory_as_deepspeed_writes_it(saved, tmp_path):
    ckpt, want = saved
    run = _run(ckpt, ckpt, tmp_path / "out", prelude=NO_SAFETENSORS)  # torch alone
    assert run.returncode == 0, run.stderr
    assert os.listdir(tmp_path / "out") == ["pytorch_model.bin"]
    assert _same(torch.load(tmp_path / "out" / "pytorch_model.bin", weights_only=True), want)
    assert run.stdout.strip().endswith(f"to {tmp_path / 'out'}: pytorch_model.bin")


def test_tag_safetensors_dtype_and_quiet(saved, tmp_path):
    ckpt, want = saved
    run = _run(ckpt, ckpt, tmp_path / "out", "-t", "global_step2", "--safe_serialization", "--dtype", "bf16", "--quiet")
    assert run.returncode == 0, run.stderr
    assert run.stdout == ""
    assert os.listdir(tmp_path / "out") == ["model.safetensors"]
    assert _same(load_file(tmp_path / "out" / "model.safetensors"), want, torch.bfloat16)


@pytest.mark.parametrize("safe", [True, False])
def test_max_shard_size_writes_hugging_face_shards_and_index(saved, tmp_path, safe):
    ckpt, want = saved
    run = _run(ckpt, ckpt / "global_step2", tmp_path / "out", "--max_shard_size", "100KB",
               *(["--safe_serialization"] if safe else []))
    assert run.returncode == 0, run.stderr
    stem, ext = ("model", ".safetensors") if safe else ("pytorch_model", ".bin")
    index = json.load(open(tmp_path / "out" / f"{stem}{ext}.index.json"))
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and shards == [f"{stem}-{k:05d}-of-{len(shards):05d}{ext}" for k in range(1, len(shards) + 1)]
    assert sorted(os.listdir(tmp_path / "out")) == sorted(shards + [f"{stem}{ext}.index.json"])
    if safe:
        got = load_consolidated(str(tmp_path / "out"))
    else:
        got = {k: v for s in shards for k, v in torch.load(tmp_path / "out" / s, weights_only=True).items()}
    assert _same(got, want)
    assert index["metadata"]["total_size"] == sum(t.numel() * 4 for t in want.values())


def test_one_output_file_as_before(saved, tmp_path):
    ckpt, want = saved
    run = _run(ckpt, ckpt, tmp_path / "out.pt")
    assert run.returncode == 0, run.stderr
    assert _same(torch.load(tmp_path / "out.pt", weights_only=True), want)
    refused = _run(ckpt, ckpt, tmp_path / "other.pt", "--max_shard_size", "1MB")
    assert refused.returncode == 2 and not os.path.exists(tmp_path / "other.pt")
    assert refused.stderr.strip() == (f"zero_to_fp32.py: error: --max_shard_size shards into an output directory, but "
                                      f"{tmp_path / 'other.pt'} names one file; give a directory instead")


def test_safe_serialization_without_safetensors_is_one_sentence(saved, tmp_path):
    ckpt, _ = saved
    run = _run(ckpt, ckpt, tmp_path / "out", "--safe_serialization", prelude=NO_SAFETENSORS)
    assert run.returncode == 2 and not os.path.exists(tmp_path / "out")
    assert run.stderr.strip() == ("zero_to_fp32.py: error: --safe_serialization needs the safetensors package, which "
                                  "is not installed (pip install safetensors); or leave the flag out for torch.save's "
                                  "format")
