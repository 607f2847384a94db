"""Fault injection: random bytes flipped in random files of a checkpoint; every read path refuses each flip
with a sentence naming the damaged file, and writes nothing.

One tiny checkpoint (TP1 x PP1 x DP1, ZeRO-1, one training step) and its universal conversion; all six
read paths run in one rank process, each on FLIPS_PER_PATH flips (seeded) drawn from the files that path
reads (a path never opens the others, so they cannot reach its output): same-layout load, reshaped load
(into ZeRO-3), universal conversion, universal load, consolidation and HF export. Each flip is undone
before the next. A clean run of every path first shows it works and what it reads back is exact.
"""
import fnmatch
import os
import random
import subprocess
import sys

import torch

from megatron_zero.checkpoint import CheckpointError, save_checkpoint
from megatron_zero.checkpoint.export.consolidate import get_fp32_state_dict
from megatron_zero.checkpoint.export.hf.exporter import export_hf
from megatron_zero.checkpoint.reshape.universal_convert import convert_to_universal
from megatron_zero.testing.checkpoint_stage import build_stage, random_train_step
from megatron_zero.testing.multirank import run_ranks
from conftest import ROOT

SEED, FLIPS_PER_PATH = 15, 10
OPTIM_AND_SHAPES = ("mp_rank_*_model_states.pt", "*optim_states.pt")
READS = {  # path -> (which checkpoint, the files it reads)
    "same-layout load": ("zero", ("*.pt",)),
    "reshaped load": ("zero", OPTIM_AND_SHAPES),
    "universal conversion": ("zero", OPTIM_AND_SHAPES),
    "universal load": ("universal", ("zero/*/fp32.pt", "zero/*/exp_avg.pt", "zero/*/exp_avg_sq.pt",
                                     "zero/optimizer_state.pt", "mp_rank_*_model_states.pt")),
    "consolidation": ("zero", OPTIM_AND_SHAPES),
    "HF export": ("zero", OPTIM_AND_SHAPES),
}


def _files(root, patterns):
    out = []
    for dirpath, _, names in os.walk(root):
        for n in names:
            rel = os.path.relpath(os.path.join(dirpath, n), root)
            if any(fnmatch.fnmatch(rel, p) for p in patterns):
                out.append(rel)
    return sorted(out)


def _flip(path, rng):
    """XOR one random byte of `path` with a random non-zero value; returns how to undo it."""
    size = os.path.getsize(path)
    pos, mask = rng.randrange(size), rng.randrange(1, 256)
    with open(path, "r+b") as f:
        f.seek(pos)
        old = f.read(1)
        f.seek(pos)
        f.write(bytes([old[0] ^ mask]))
    return pos, old


def _unflip(path, pos, old):
    with open(path, "r+b") as f:
        f.seek(pos)
        f.write(old)


def _paths(save_dir, tag_dir, universal_dir, work):
    """name -> a function running that read path once (raising CheckpointError on a damaged file)."""
    from megatron_zero.checkpoint.resume import resume_checkpoint

    def load(zero, path, universal=False):
        state, _, model, opt = build_stage(1, 1, zero)
        resume_checkpoint(path, state, model, opt, universal=universal, log=lambda line: None)
        return {k: v.detach().clone() for k, v in model.state_dict().items()} if zero < 3 else None

    def convert():
        out = os.path.join(work, "universal_try")
        try:
            convert_to_universal(tag_dir, out, merge_workers=1, progress=False)
        finally:
            assert not [n for n in os.listdir(work) if n.startswith("universal_try.tmp")], "partial output kept"
        os.rename(out, os.path.join(work, "universal_ok"))  # a clean run: out of the way for the next
        os.remove(os.path.join(work, "latest_universal"))

    return {"same-layout load": lambda: load(1, save_dir),
            "reshaped load": lambda: load(3, save_dir),
            "universal conversion": convert,
            "universal load": lambda: load(1, universal_dir, universal=True),
            "consolidation": lambda: get_fp32_state_dict(tag_dir),
            "HF export": lambda: export_hf(tag_dir, os.path.join(work, "hf"), num_heads=4)}


def _save_tiny(save_dir):
    state, config, model, opt = build_stage(1, 1, 1)
    random_train_step(state, config, model, opt)
    save_checkpoint(save_dir, 1, state, model, opt, {"iteration": 1})
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _inject(save_dir):
    want = _save_tiny(save_dir)
    tag_dir = os.path.join(save_dir, "global_step1")
    work = os.path.join(os.path.dirname(save_dir), "work")
    os.makedirs(work)
    universal_dir = os.path.join(work, "universal")
    convert_to_universal(tag_dir, universal_dir, merge_workers=1, progress=False)
    paths = _paths(save_dir, tag_dir, universal_dir, work)
    got = paths["same-layout load"]()  # clean runs: every path works, loads are exact
    assert all(torch.equal(got[k], want[k]) for k in want)
    for name, run in paths.items():
        run()
    rng = random.Random(SEED)
    detected = {}
    for name, (which, patterns) in READS.items():
        root = tag_dir if which == "zero" else universal_dir
        candidates = _files(root, patterns)
        detected[name] = 0
        for _ in range(FLIPS_PER_PATH):
            rel = rng.choice(candidates)
            path = os.path.join(root, rel)
            pos, old = _flip(path, rng)
            try:
                paths[name]()
            except CheckpointError as e:
                message = str(e)
                assert path in message and "\n" not in message, (name, rel, message)
                detected[name] += 1
            else:
                raise AssertionError(f"{name} read {rel} with byte {pos} flipped without a word")
            finally:
                _unflip(path, pos, old)
    return detected


def test_every_read_path_refuses_every_flipped_byte(tmp_path):
    detected = run_ranks(_inject, 1, str(tmp_path / "ckpt"), timeout=600)[0]
    print("flips detected per path:", detected)
    assert detected == {name: FLIPS_PER_PATH for name in READS}
    assert sum(detected.values()) >= 50


def test_tools_refuse_a_flipped_byte_unless_told_not_to_verify(tmp_path):
    save_dir = str(tmp_path / "ckpt")
    run_ranks(_save_tiny, 1, save_dir, timeout=300)
    damaged = os.path.join(save_dir, "global_step1", "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    with open(damaged, "r+b") as f:  # the middle of the file: tensor bytes, so it still unpickles
        f.seek(os.path.getsize(damaged) // 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0x40]))
    tool = [sys.executable, os.path.join(ROOT, "tools", "zero_to_fp32.py"), save_dir, str(tmp_path / "out"), "--quiet"]
    refused = subprocess.run(tool, capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and refused.stderr.startswith(
        f"zero_to_fp32.py: error: the checkpoint file {damaged} fails its checksum"), refused.stderr
    assert not os.path.exists(tmp_path / "out" / "pytorch_model.bin")
    unverified = subprocess.run(tool + ["--no-verify-checkpoint"], capture_output=True, text=True, timeout=120)
    assert unverified.returncode == 0 and os.path.exists(tmp_path / "out" / "pytorch_model.bin"), unverified.stderr
