"""The command line as a user drives it: pretrain_gpt.py on local ranks, tools/ds_to_universal.py and
tools/convert_from_hf.py as subprocesses, the architectures' flags, and each iteration's logged loss.

    run = pretrain_cli(2, cli_flags(data, save, "llama", {"tensor-model-parallel-size": 2}))
    losses = logged_losses(run)                         # {iteration: lm loss}
    tool("ds_to_universal.py", "--input_folder", src, "--output_folder", dst)

Every command is checked for exit status 0; a failure shows its output's tail. For a source checkout
(pretrain_gpt.py and tools/ next to the package), which is where the tests run.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from typing import Dict, List, Optional

from .launch import PRETRAIN, ROOT, flags_argv
from .multirank import free_port

# Megatron flags of each architecture on top of the tiny model below; "mistral" is written in
# Megatron-DeepSpeed's spellings and has one key/value head (multi-query attention).
ARCHITECTURES = {
    "gpt2": {},
    "llama": {"normalization": "RMSNorm", "norm-epsilon": 1e-6, "position-embedding-type": "rope", "swiglu": True,
              "group-query-attention": True, "num-query-groups": 2, "untie-embeddings-and-output-weights": True,
              "disable-bias-linear": True},
    "mistral": {"normalization": "rmsnorm", "norm-epsilon": 1e-5, "use-rotary-position-embeddings": True,
                "rotary-base": 1000000, "swiglu": True, "num-key-value-heads": 1,
                "untie-embeddings-and-output-weights": True, "disable-bias-linear": True},
}
# a 2-layer model with 4 heads of 8 on byte-level text, 8 sequences of 16 tokens a step, no dropout
TINY = {"num-layers": 2, "hidden-size": 32, "num-attention-heads": 4, "seq-length": 16, "micro-batch-size": 2,
        "global-batch-size": 8, "lr": 3e-3, "min-lr": 3e-4, "lr-decay-style": "cosine", "lr-warmup-iters": 1,
        "hidden-dropout": 0.0, "attention-dropout": 0.0, "tokenizer-type": "ByteTokenizer", "split": "100,0,0",
        "eval-iters": 0, "log-interval": 1, "seed": 11}


def layout_flags(tp: int = 1, pp: int = 1, zero: int = 1) -> dict:
    return {"tensor-model-parallel-size": tp, "pipeline-model-parallel-size": pp, "zero-stage": zero}


def cli_flags(data: str, cache: str, architecture: Optional[str] = "gpt2", *changes: dict) -> List[str]:
    """pretrain_gpt.py's flags: TINY with `architecture`'s flags (None: none, e.g. given by an import's
    megatron_flags.txt), on `data`, then each dict of `changes` in turn (None/False drops a flag)."""
    flags = {**TINY, **(ARCHITECTURES[architecture] if architecture else {}), "data-path": data,
             "data-cache-path": cache}
    for change in changes:
        flags.update(change)
    return flags_argv(flags)


def _checked(run: subprocess.CompletedProcess, what: str) -> subprocess.CompletedProcess:
    if run.returncode != 0:
        raise AssertionError(f"{what} exited {run.returncode}:\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}")
    return run


def pretrain_cli(nproc: int, argv: List[str], timeout: int = 300) -> subprocess.CompletedProcess:
    """pretrain_gpt.py on `nproc` local ranks through torchrun (one thread each), as scripts/pretrain_local.sh
    starts it; asserts exit status 0."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port",
           str(free_port()), PRETRAIN] + [str(a) for a in argv]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return _checked(run, "pretrain_gpt.py " + " ".join(str(a) for a in argv))


def tool(script: str, *argv, timeout: int = 180) -> subprocess.CompletedProcess:
    """tools/<script> with `argv`; asserts exit status 0."""
    run = subprocess.run([sys.executable, os.path.join(ROOT, "tools", script)] + [str(a) for a in argv],
                         capture_output=True, text=True, timeout=timeout, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return _checked(run, f"tools/{script}")


def logged_losses(run: subprocess.CompletedProcess) -> Dict[int, float]:
    """{iteration: lm loss} from every train line of a run's log."""
    found = re.findall(r"iteration +(\d+)/ *\d+ \|.*?\| lm loss: ([0-9.E+-]+)", run.stdout)
    return {int(it): float(loss) for it, loss in found}


def imported_flags(checkpoint: str) -> List[str]:
    """The model flags tools/convert_from_hf.py wrote beside its import (megatron_flags.txt)."""
    import shlex

    from ..checkpoint.export.hf.importer import FLAGS_FILE

    with open(os.path.join(checkpoint, FLAGS_FILE)) as f:
        return shlex.split(f.read())
