"""The zero_to_fp32.py copied into every checkpoint checks each file it reads against manifest.json.

Run as users run it: the copy in the checkpoint, in a fresh interpreter without megatron_zero on the
path. An intact checkpoint converts to what the package's consolidation gives (bit-exact); a flipped
byte or a truncated file is refused with one sentence naming it and nothing is written; without the
`crc32c` package (blocked in the child) a crc32c manifest stops the script with one sentence unless
--no-verify-checkpoint is given, and a crc32 manifest (older versions) is still verified with zlib.
"""
import json
import os
import re
import subprocess
import sys

import pytest
import torch

from megatron_zero.checkpoint import save_checkpoint
from megatron_zero.checkpoint.export.consolidate import get_fp32_state_dict
from megatron_zero.checkpoint.storage.checksum import file_checksum
from megatron_zero.testing.checkpoint_stage import build_stage, random_train_step
from megatron_zero.testing.multirank import run_ranks

OPTIM = "zero_pp_rank_0_mp_rank_00_optim_states.pt"
NO_CRC32C = "import sys; sys.modules['crc32c'] = None; "


def _save(save_dir):
    state, config, model, opt = build_stage(1, 1, 1)
    random_train_step(state, config, model, opt)
    save_checkpoint(save_dir, 1, state, model, opt, {"iteration": 1})


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    save_dir = str(tmp_path_factory.mktemp("ckpt"))
    run_ranks(_save, 1, save_dir, timeout=300)
    tag_dir = os.path.join(save_dir, "global_step1")
    return save_dir, tag_dir, {k: v.clone() for k, v in get_fp32_state_dict(tag_dir).items()}


def _convert(save_dir, out, *flags, prelude=""):
    script = os.path.join(save_dir, "global_step1", "zero_to_fp32.py")
    code = prelude + (f"import runpy; sys.argv = {[script, save_dir, str(out), *flags]!r}; "
                      f"runpy.run_path({script!r}, run_name='__main__')")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([sys.executable, "-c", "import sys; " + code], capture_output=True, text=True,
                          timeout=120, env=env, cwd=os.path.dirname(script))


def _same(out, want):
    got = torch.load(out, weights_only=True)
    return list(got) == list(want) and all(torch.equal(got[k], want[k]) for k in want)


def test_an_intact_checkpoint_converts_as_before(checkpoint, tmp_path):
    save_dir, _, want = checkpoint
    done = _convert(save_dir, tmp_path / "out.pt")
    assert done.returncode == 0, done.stderr
    assert _same(tmp_path / "out.pt", want)


def _damaged(tag_dir, name, damage):
    path = os.path.join(tag_dir, name)
    with open(path, "rb") as f:
        original = f.read()
    with open(path, "wb") as f:
        f.write(damage(original))
    return path, original


@pytest.mark.parametrize("how", ["flipped byte", "truncated"])
def test_a_damaged_file_is_named_and_refused(checkpoint, tmp_path, how):
    save_dir, tag_dir, _ = checkpoint
    damage = {"flipped byte": lambda b: b[:len(b) // 2] + bytes([b[len(b) // 2] ^ 0x10]) + b[len(b) // 2 + 1:],
              "truncated": lambda b: b[:-7]}[how]
    path, original = _damaged(tag_dir, OPTIM, damage)
    try:
        done = _convert(save_dir, tmp_path / "out.pt")
    finally:
        with open(path, "wb") as f:
            f.write(original)
    want = (rf"the checkpoint file {path} is damaged: its crc32c checksum is [0-9a-f]{{8}} but the manifest "
            r"records [0-9a-f]{8}; not converting" if how == "flipped byte" else
            rf"the checkpoint file {path} is {len(original) - 7} bytes but its manifest records {len(original)}: "
            "it is truncated or damaged")
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert re.fullmatch(rf"zero_to_fp32\.py: error: {want}\n", done.stderr), done.stderr
    assert not os.path.exists(tmp_path / "out.pt")


def test_without_crc32c_it_stops_unless_told_and_crc32_manifests_still_verify(checkpoint, tmp_path):
    save_dir, tag_dir, want = checkpoint
    stopped = _convert(save_dir, tmp_path / "a.pt", prelude=NO_CRC32C)
    assert stopped.returncode == 2 and "needs the `crc32c` package" in stopped.stderr, stopped.stderr
    assert "--no-verify-checkpoint" in stopped.stderr and stopped.stderr.count("\n") == 1
    assert not os.path.exists(tmp_path / "a.pt")
    told = _convert(save_dir, tmp_path / "b.pt", "--no-verify-checkpoint", prelude=NO_CRC32C)
    assert told.returncode == 0 and _same(tmp_path / "b.pt", want), told.stderr
    manifest_path = os.path.join(tag_dir, "manifest.json")
    with open(manifest_path) as f:
        original = f.read()
    manifest = json.loads(original)
    for name, info in manifest["files"].items():  # as an earlier version recorded them
        info["checksum"] = file_checksum(os.path.join(tag_dir, name), "crc32")
    try:
        with open(manifest_path, "w") as f:
            json.dump(manifest, f)
        zlib_ok = _convert(save_dir, tmp_path / "c.pt", prelude=NO_CRC32C)
        path, blob = _damaged(tag_dir, OPTIM, lambda b: b[:-1] + bytes([b[-1] ^ 1]))
        zlib_bad = _convert(save_dir, tmp_path / "d.pt", prelude=NO_CRC32C)
        with open(path, "wb") as f:
            f.write(blob)
    finally:
        with open(manifest_path, "w") as f:
            f.write(original)
    assert zlib_ok.returncode == 0 and _same(tmp_path / "c.pt", want), zlib_ok.stderr
    assert zlib_bad.returncode == 2 and f"the checkpoint file {path} is damaged: its crc32 checksum" in zlib_bad.stderr
