"""Launching pretrain_gpt.py from tests: Megatron flags from a dict, torchrun on a free port, losses from a log;
a tiny byte-level GPT on a byte corpus written here, launched as one process (the startup and fault tests).

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
    return flags_argv(flags)


def flags_argv(flags) -> List[str]:
    """{"flag-name": value} -> argv; True is a switch, None and False leave the flag out, a list gives an
    nargs flag its values."""
    argv = []
    for k, v in flags.items():
        if v is True:
            argv.append(f"--{k}")
        elif isinstance(v, list):
            argv += [f"--{k}"] + [str(x) for x in v]
        elif v is not None and v is not False:
            argv += [f"--{k}", str(v)]
    return argv


def byte_data(prefix, top=255, docs=40, seed=0) -> str:
    """An indexed dataset of `docs` random byte documents ending in 256 (EOD); one document holds `top`."""
    import numpy as np

    from ..data.indexed_dataset import IndexedDatasetBuilder

    rng = np.random.default_rng(seed)
    builder = IndexedDatasetBuilder(str(prefix), dtype=np.uint16)
    for d in range(docs):
        tokens = list(rng.integers(0, 256, size=60)) + [256]
        if d == docs // 2:
            tokens[3] = top
        builder.add_document(tokens)
    builder.finalize()
    return str(prefix)


def tiny_flags(tmp_path, data, **changes) -> List[str]:
    """pretrain_gpt.py flags of a 2-layer byte-level GPT on `data`, saving under tmp_path/ckpt."""
    flags = {"num-layers": 2, "hidden-size": 32, "num-attention-heads": 4, "seq-length": 16, "micro-batch-size": 2,
             "global-batch-size": 4, "lr": 1e-3, "train-iters": 2, "tokenizer-type": "ByteTokenizer",
             "data-path": data, "split": "100,0,0", "eval-iters": 0, "log-interval": 1,
             "save": tmp_path / "ckpt", "data-cache-path": tmp_path / "cache"}
    flags.update(changes)
    return flags_argv(flags)


def pretrain(tmp_path, data, **changes) -> subprocess.CompletedProcess:
    """pretrain_gpt.py with tiny_flags on one process (a free port, one thread)."""
    env = {**os.environ, "MASTER_PORT": str(free_port()), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, PRETRAIN] + tiny_flags(tmp_path, data, **changes), capture_output=True,
                          text=True, timeout=180, env=env)


def torchrun(nproc, argv, timeout=300) -> subprocess.CompletedProcess:
    """pretrain_gpt.py on `nproc` local ranks (torchrun, a free port, one thread each)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
           "--master_port", str(free_port()), PRETRAIN] + argv
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)


def losses_from_log(stdout) -> List[float]:
    """The `lm loss` of every train line."""
    return [float(x) for x in re.findall(r"lm loss: ([0-9.E+-]+)", stdout)]
