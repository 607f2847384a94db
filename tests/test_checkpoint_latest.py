"""A `latest` that names no checkpoint, through pretrain_gpt.py as a user runs it.

`latest` is written by tmp + rename after the checkpoint it names is complete, so one that holds damaged
bytes, no directory name, or the name of a directory that is gone is not the commit's doing: it is
treated as a missing `latest` is. With committed checkpoints beside it, the run resumes from the newest
that verifies, with one line naming the file and what it holds; without any, it is refused in one
sentence naming the file, from one rank, exit status 2, no traceback. A damaged `latest_universal` (the
pointer tools/ds_to_universal.py writes) is one sentence naming it.
"""
import os
import random
import subprocess
import sys

import pytest

from conftest import ROOT

from megatron_zero.testing.launch import PRETRAIN, byte_data, pretrain, tiny_flags
from megatron_zero.testing.multirank import free_port

GARBAGE = b"\xff" + random.Random(0).randbytes(39)  # 40 bytes, not UTF-8 (0xff never is)


def test_a_damaged_latest_resumes_from_the_newest_verified_checkpoint(tmp_path):
    data, ckpt = byte_data(tmp_path / "bytes"), tmp_path / "ckpt"
    first = pretrain(tmp_path, data, **{"save-interval": 1})
    assert first.returncode == 0, first.stderr[-3000:]
    latest = ckpt / "latest"
    latest.write_bytes(GARBAGE)
    resumed = pretrain(tmp_path, data, load=ckpt, **{"train-iters": 3, "override-opt_param-scheduler": True})
    assert resumed.returncode == 0 and "Traceback" not in resumed.stderr, resumed.stderr[-3000:]
    assert (f"{latest} holds 40 bytes that are not UTF-8 text, so it is ignored; resuming from its newest "
            "verified checkpoint global_step2\n") in resumed.stdout, resumed.stdout
    assert "from iteration 2 " in resumed.stdout and latest.read_text() == "global_step3"


@pytest.mark.slow
def test_a_latest_naming_a_directory_that_is_gone_resumes_from_the_newest_verified_checkpoint(tmp_path):
    data, ckpt = byte_data(tmp_path / "bytes"), tmp_path / "ckpt"
    first = pretrain(tmp_path, data, **{"save-interval": 1})
    assert first.returncode == 0, first.stderr[-3000:]
    latest = ckpt / "latest"
    latest.write_text("global_step9\n")  # its directory deleted by hand
    resumed = pretrain(tmp_path, data, load=ckpt, **{"train-iters": 3, "override-opt_param-scheduler": True})
    assert resumed.returncode == 0 and "Traceback" not in resumed.stderr, resumed.stderr[-3000:]
    assert (f"{latest} names global_step9, but the directory {ckpt / 'global_step9'} does not exist, so it is "
            "ignored; resuming from its newest verified checkpoint global_step2\n") in resumed.stdout, resumed.stdout


def test_a_damaged_latest_with_no_checkpoint_beside_it_is_one_sentence_from_one_rank(tmp_path):
    data, load = byte_data(tmp_path / "bytes"), tmp_path / "damaged"
    load.mkdir()
    (load / "latest").write_bytes(GARBAGE)
    run = subprocess.run(["bash", os.path.join(ROOT, "scripts", "pretrain_torchrun.sh"), "--nproc_per_node", "2",
                          "--master_addr", "127.0.0.1", "--master_port", str(free_port()), PRETRAIN]
                         + tiny_flags(tmp_path, data, load=load), capture_output=True, text=True, timeout=240,
                         env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHON": sys.executable})
    out = run.stdout + run.stderr
    assert run.returncode == 2, out[-3000:]
    errors = [line for line in out.splitlines() if "error:" in line]
    assert errors == [f"pretrain_gpt.py: error: {load / 'latest'} holds 40 bytes that are not UTF-8 text; it should "
                      f"name a checkpoint directory in {load}, such as global_step100, and no other checkpoint there "
                      "is complete"], out[-3000:]
    for noise in ("Traceback", "UnicodeDecodeError", "ChildFailedError"):
        assert noise not in out, (noise, out[-3000:])


def test_a_damaged_latest_universal_is_one_sentence(tmp_path):
    from megatron_zero.checkpoint import CheckpointError
    from megatron_zero.checkpoint.resume import find_resume_point

    (tmp_path / "latest_universal").write_bytes(GARBAGE)
    with pytest.raises(CheckpointError) as refused:
        find_resume_point(str(tmp_path), universal=True)
    assert str(refused.value) == (f"{tmp_path / 'latest_universal'} holds 40 bytes that are not UTF-8 text; it should "
                                  "hold the name of the universal checkpoint directory beside it")
