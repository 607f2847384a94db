"""What pretrain_gpt.py says about a run, driven from the command line: the start-up line names the architecture,
the layout, the ZeRO stage and the dtype; every save says where, how long and how fast; every load says which
checkpoint (tag, plain / universal / Hugging Face import, the layout it was saved at); and a resume at or past
--train-iters says in one line that there is nothing to train, and leaves the checkpoint alone."""
import os
import re
import subprocess
import sys

import pytest

from megatron_zero.testing.launch import ROOT, byte_data, pretrain

pytestmark = pytest.mark.multirank  # each test launches pretrain_gpt.py

LLAMA = {"normalization": "RMSNorm", "position-embedding-type": "rope", "swiglu": True,
         "group-query-attention": True, "num-query-groups": 2, "untie-embeddings-and-output-weights": True,
         "disable-bias-linear": True}
LONGER = {"override-opt_param-scheduler": True}  # a resume at another --train-iters, as Megatron-LM takes it
SAVED = re.compile(r"^saved checkpoint (\S+) in [0-9.]+ s \([0-9.]+ (?:B|kB|MB|GB), [0-9.]+ (?:B|kB|MB|GB)/s\)$", re.M)


def _ok(run):
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    return run.stdout


def _tool(name, *argv):
    return subprocess.run([sys.executable, os.path.join(ROOT, "tools", name), *map(str, argv)], capture_output=True,
                          text=True, timeout=180)


def test_startup_line_names_the_architecture_zero_stage_and_dtype(tmp_path):
    out = _ok(pretrain(tmp_path, byte_data(tmp_path / "bytes"), save=None, **{"zero-stage": 2}, **LLAMA))
    assert "training a 2-layer Llama (2 query groups) model on TP=1 x PP=1 x DP=1, ZeRO-2, fp32, from iteration 0 " \
           "(0 samples consumed), 2 micro-batches per step" in out.splitlines(), out


def test_a_save_and_a_load_are_logged(tmp_path):
    data = byte_data(tmp_path / "bytes")
    ckpt = tmp_path / "ckpt"
    out = _ok(pretrain(tmp_path, data, **{"zero-stage": 1}))
    assert SAVED.findall(out) == [str(ckpt / "global_step2")], out
    out = _ok(pretrain(tmp_path, data, load=ckpt, **{"zero-stage": 1, "train-iters": 3, **LONGER}))
    assert f"loaded checkpoint global_step2 (plain, iteration 2, saved at TP=1 x PP=1 x DP=1, ZeRO-1) from " \
           f"{ckpt / 'global_step2'}" in out.splitlines(), out
    assert SAVED.findall(out) == [str(ckpt / "global_step3")], out


@pytest.mark.slow  # the default tier's test_a_save_and_a_load_are_logged covers the plain load's line
def test_every_kind_of_load_is_logged(tmp_path):
    """A plain checkpoint reshaped while loading (ZeRO-1 -> 3), a universal one (from a ZeRO-3 save), and a
    Hugging Face import (convert_to_hf.py, then convert_from_hf.py)."""
    data = byte_data(tmp_path / "bytes")
    ckpt = tmp_path / "ckpt"
    _ok(pretrain(tmp_path, data, **{"zero-stage": 1, "train-iters": 3}))
    out = _ok(pretrain(tmp_path, data, load=ckpt, **{"zero-stage": 3, "train-iters": 4, **LONGER}))  # reshaped: stage 1 -> 3
    assert f"loaded checkpoint global_step3 (plain, iteration 3, saved at TP=1 x PP=1 x DP=1, ZeRO-1) from " \
           f"{ckpt / 'global_step3'}, reshaped to TP=1 x PP=1 x DP=1, ZeRO-3" in out.splitlines(), out
    universal = tmp_path / "ckpt" / "global_step4_universal"
    _ok(_tool("ds_to_universal.py", "--input_folder", ckpt / "global_step4", "--output_folder", universal))
    out = _ok(pretrain(tmp_path, data, load=ckpt, save=tmp_path / "ckpt2",
                       **{"universal-checkpoint": True, "zero-stage": 1, "train-iters": 5, **LONGER}))
    assert f"loaded checkpoint global_step4_universal (universal, iteration 4, saved at TP=1 x PP=1 x DP=1, ZeRO-3) " \
           f"from {universal}, reshaped to TP=1 x PP=1 x DP=1, ZeRO-1" in out.splitlines(), out
    hf, imported = tmp_path / "hf", tmp_path / "imported"
    _ok(_tool("convert_to_hf.py", ckpt, hf))
    _ok(_tool("convert_from_hf.py", "--input-dir", hf, "--output-dir", imported))
    out = _ok(pretrain(tmp_path, data, load=imported, save=tmp_path / "ckpt3", **{"train-iters": 1}))
    assert f"loaded the Hugging Face import imported (GPT2LMHeadModel, weights only: a fresh optimizer at iteration 0) " \
           f"from {imported}" in out.splitlines(), out


def test_resuming_at_or_past_train_iters_says_there_is_nothing_to_train(tmp_path):
    data = byte_data(tmp_path / "bytes")
    ckpt = tmp_path / "ckpt"
    _ok(pretrain(tmp_path, data, **{"train-iters": 3}))
    before = {f: os.stat(ckpt / "global_step3" / f).st_mtime_ns for f in os.listdir(ckpt / "global_step3")}
    out = _ok(pretrain(tmp_path, data, load=ckpt, **{"train-iters": 2, **LONGER}))  # "at" takes the same branch
    want = ("nothing to train: the checkpoint loaded from --load {ckpt} is at iteration 3, at or past "
            "--train-iters 2; raise --train-iters above 3 to train on").format(ckpt=ckpt)
    assert want in out.splitlines(), out
    assert " iteration " not in out.split(want)[1] and not SAVED.search(out), out  # no step, no save
    out = _ok(pretrain(tmp_path, data, load=ckpt, **{"train-iters": None, "train-samples": 12, **LONGER}))
    assert ("nothing to train: the checkpoint loaded from --load {ckpt} is at iteration 3, at or past "
            "--train-samples 12 (3 iterations); raise --train-samples above 12 to train on").format(ckpt=ckpt) \
        in out.splitlines(), out
    assert {f: os.stat(ckpt / "global_step3" / f).st_mtime_ns for f in os.listdir(ckpt / "global_step3")} == before
