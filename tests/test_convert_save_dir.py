"""The converters take the save directory --load takes (`latest` beside the checkpoints) and follow `latest` as --load
does: tools/convert_checkpoint.py --from deepspeed and tools/ds_to_universal.py, from the command line, with no
claim that our own save is foreign; the progress line counts MiB where the checkpoint is under a GiB."""
import os
import subprocess
import sys

import pytest

from megatron_zero.testing.launch import byte_data, pretrain

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def save_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("save_dir")
    run = pretrain(root, byte_data(str(root / "bytes")), **{"save-interval": 2})
    assert run.returncode == 0, run.stderr[-2000:]
    return root / "ckpt"


def tool(*argv):
    return subprocess.run([sys.executable, os.path.join(ROOT, "tools", argv[0])] + [str(a) for a in argv[1:]],
                          capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("to", ["universal", pytest.param("torch_dist", marks=pytest.mark.slow)])  # default: universal
def test_convert_checkpoint_follows_latest(save_dir, tmp_path, to):
    run = tool("convert_checkpoint.py", "--from", "deepspeed", "--to", to, "--input", save_dir, "--output",
               tmp_path / "out")
    assert run.returncode == 0, run.stderr[-2000:]
    assert "not written by megatron_zero" not in run.stderr and "Traceback" not in run.stderr
    assert "iteration 2" in run.stdout and "MiB, " in run.stderr


def test_ds_to_universal_follows_latest(save_dir, tmp_path):
    run = tool("ds_to_universal.py", "--input_folder", save_dir, "--output_folder", tmp_path / "universal")
    assert run.returncode == 0, run.stderr[-2000:]
    assert "not written by megatron_zero" not in run.stderr
    assert os.path.isfile(tmp_path / "universal" / "zero" / "optimizer_state.pt") or \
        os.path.isdir(tmp_path / "universal" / "zero")
