"""Launching pretrain_gpt.py from tests: Megatron flags from a dict, torchrun on a free port, losses from a log.

For a source checkout (pretrain_gpt.py next to the package), which is where the tests run.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from typing import List

from .multirank import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PRETRAIN = os.path.join(ROOT, "pretrain_gpt.py")


def model_flags(data, tok, **extra) -> List[str]:
    """A 2-layer GPT on `data` with tokenizer `tok`; `extra` overrides or adds flags (True: a switch)."""
    flags = {"num-layers": 2, "hidden-size": 64, "num-attention-heads": 4, "seq-length": 64,
             "micro-batch-size": 2, "global-batch-size": 8, "lr": 3e-3, "min-lr": 3e-4,
             "lr-decay-style": "cosine", "lr-warmup-iters": 2, "train-iters": 12, "log-interval": 1,
             "eval-interval": 6, "eval-iters": 1, "data-path": data, "tokenizer-type": "GPTSentencePieceTokenizer",
             "tokenizer-model": tok, "split": "98,2,0", "hidden-dropout": 0.0, "attention-dropout": 0.0,
             "seed": 7}
    flags.update(extra)
    argv = []
    for k, v in flags.items():
        if v is True:
            argv.append(f"--{k}")
        elif v is not None and v is not False:
            argv += [f"--{k}", str(v)]
    return argv


def torchrun(nproc, argv, timeout=300) -> subprocess.CompletedProcess:
    """pretrain_gpt.py on `nproc` local ranks (torchrun, a free port, one thread each)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
           "--master_port", str(free_port()), PRETRAIN] + argv
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)


def losses_from_log(stdout) -> List[float]:
    """The `lm loss` of every train line."""
    return [float(x) for x in re.findall(r"lm loss: ([0-9.E+-]+)", stdout)]
