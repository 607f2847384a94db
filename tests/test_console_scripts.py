"""`pip install -e .` puts every tool on the PATH of the environment as a console script."""
import os
import subprocess
import sys

import pytest

SCRIPTS = ["megatron-zero-pretrain", "megatron-zero-ds-to-universal", "megatron-zero-zero-to-fp32",
           "megatron-zero-convert-to-hf", "megatron-zero-preprocess-data", "megatron-zero-train-tokenizer",
           "megatron-zero-build-corpus", "megatron-zero-generate-text"]


@pytest.mark.parametrize("name", SCRIPTS)
def test_console_script_runs(name, tmp_path):
    path = os.path.join(os.path.dirname(sys.executable), name)
    assert os.path.exists(path), f"{name} is not installed next to {sys.executable}"
    run = subprocess.run([path, "--help"], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert run.returncode == 0 and "usage:" in run.stdout, run.stderr[-2000:]
