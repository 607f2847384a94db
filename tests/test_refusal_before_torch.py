"""A bad flag is refused before torch loads, as a user meets it: pretrain_gpt.py run directly, and through
scripts/pretrain_torchrun.sh on 2 ranks (the launcher README's pretrain_local.sh runs), which checks the flags
before torchrun imports torch. Python's own import log (PYTHONPROFILEIMPORTTIME) shows what was imported
before the refusal: nothing of torch; the output is that one sentence and nothing else, exit status 2. The
time to the refusal is printed (pytest -s); a timing is not asserted (the machine may be loaded)."""
import os
import re
import subprocess
import sys
import time

import pytest

from megatron_zero.testing.launch import PRETRAIN, ROOT
from megatron_zero.testing.multirank import free_port

FLAGS = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
         "--micro-batch-size", "1", "--global-batch-size", "2", "--lr", "1e-3", "--train-iters", "2", "--mock-data",
         "--tokenizer-type", "NullTokenizer", "--vocab-size", "100"]
IMPORT_LOG = re.compile(r"^import time:")
TORCH = re.compile(r"\|\s+torch(\.\S+)?$")


def _refused(command, extra):
    env = {**os.environ, "PYTHONPROFILEIMPORTTIME": "1", "OMP_NUM_THREADS": "1", "PYTHON": sys.executable}
    start = time.monotonic()
    run = subprocess.run(command + FLAGS + extra, capture_output=True, text=True, env=env, timeout=300)
    seconds = time.monotonic() - start
    lines = (run.stdout + run.stderr).splitlines()
    imported = [line for line in lines if IMPORT_LOG.match(line)]
    said = [line for line in lines if not IMPORT_LOG.match(line)]
    print(f"\n{' '.join(os.path.basename(c) for c in command[:2])} {' '.join(extra)}: refused in {seconds:.2f} s, "
          f"{len(imported)} modules imported")
    assert run.returncode == 2, "\n".join(said[-30:])
    assert [line for line in imported if TORCH.search(line)] == [], "torch was imported before the refusal"
    return said


@pytest.mark.parametrize("bad,sentence", [
    (["--bogus-flag"], "pretrain_gpt.py: error: --bogus-flag is not a flag of megatron_zero's pretrain_gpt.py"),
    (["--tensor-model-parallel-size", "3"], "pretrain_gpt.py: error: world size 2 is not divisible by "
                                            "--tensor-model-parallel-size 3"),
])
def test_the_launcher_refuses_a_bad_flag_before_torch_loads(bad, sentence):
    launcher = ["bash", os.path.join(ROOT, "scripts", "pretrain_torchrun.sh"), "--nproc_per_node", "2",
                "--master_addr", "127.0.0.1", "--master_port", str(free_port()), PRETRAIN]
    said = _refused(launcher, bad)
    assert len(said) == 1 and said[0].startswith(sentence), said


def test_pretrain_gpt_refuses_a_bad_flag_before_torch_loads():
    said = _refused([sys.executable, PRETRAIN], ["--bogus-flag"])
    assert len(said) == 1 and said[0].startswith("pretrain_gpt.py: error: --bogus-flag is not a flag"), said
