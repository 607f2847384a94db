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
from typing import Callable, Dict, List, Optional

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


def text_data(prefix: str, docs: int = 60, chars: int = 200) -> str:
    """An indexed dataset of ByteTokenizer ids (UTF-8 bytes, 256 ends a document): `docs` documents of
    `chars` bytes of Python's argparse.py source, text a tiny model learns from in a few steps."""
    import argparse

    import numpy as np

    from ..data.indexed_dataset import IndexedDatasetBuilder

    with open(argparse.__file__, "rb") as f:
        text = f.read(docs * chars)
    builder = IndexedDatasetBuilder(str(prefix), dtype=np.uint16)
    for d in range(docs):
        builder.add_document(list(text[d * chars:(d + 1) * chars]) + [256])
    builder.finalize()
    return str(prefix)


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


def mtp_losses(run: subprocess.CompletedProcess) -> Dict[int, float]:
    """{iteration: mtp_1 loss} (the first multi-token prediction depth's) from a run's log."""
    return {int(it): float(v) for it, v in re.findall(r"iteration +(\d+) \| mtp_1 loss: ([0-9.E+-]+)", run.stdout)}


class CliResume:
    """One uninterrupted run through pretrain_gpt.py that saves at `save_at` on the way to `iters`, and runs
    resumed from that checkpoint: as saved, reshaped while loading at another layout, or converted by
    tools/ds_to_universal.py and loaded with --universal-checkpoint.

    `flags(*changes)` gives pretrain_gpt.py's argv with each dict of changes applied (cli_flags' order);
    every run gets `layout` and then the run's own layout changes."""

    def __init__(self, root: str, flags: Callable[..., List[str]], layout: dict, nproc: int = 2,
                 iters: int = 6, save_at: int = 3):
        self.root, self.flags, self.layout, self.nproc = root, flags, layout, nproc
        self.iters, self.save_at = iters, save_at
        self.save = os.path.join(root, "ckpt")
        self.checkpoint = os.path.join(self.save, f"global_step{save_at}")
        self._universal = None
        run = self._run({"save": self.save, "save-interval": save_at})
        self.stdout = run.stdout  # the uninterrupted run's log
        self.losses = logged_losses(run)
        assert sorted(self.losses) == list(range(1, iters + 1)), run.stdout[-2000:]

    def _run(self, *changes) -> subprocess.CompletedProcess:
        return pretrain_cli(self.nproc, self.flags({"train-iters": self.iters}, self.layout, *changes))

    @property
    def universal(self) -> str:
        """The checkpoint converted by tools/ds_to_universal.py (once)."""
        if self._universal is None:
            out = os.path.join(self.root, f"global_step{self.save_at}_universal")
            tool("ds_to_universal.py", "--input_folder", self.checkpoint, "--output_folder", out,
                 "--num_merge_workers", 1, "--quiet")
            self._universal = out
        return self._universal

    def resume(self, how: str = "as saved", layout: Optional[dict] = None) -> Dict[int, float]:
        """The losses of a run resumed `how` ("as saved", "reshaped", "universal") at `layout` (changes to
        the saved one)."""
        return logged_losses(self.resume_run(how, layout))

    def resume_run(self, how: str = "as saved", layout: Optional[dict] = None) -> subprocess.CompletedProcess:
        """That resumed run itself (its whole log)."""
        load = {"load": self.universal, "universal-checkpoint": True} if how == "universal" else \
            {"load": self.checkpoint}
        return self._run(load, layout or {})

    def assert_matches(self, resumed: Dict[int, float], rel: float) -> None:
        """Every iteration after the checkpoint's, within `rel` of the uninterrupted run (0: bit-identical)."""
        assert sorted(resumed) == list(range(self.save_at + 1, self.iters + 1)), resumed
        for it, loss in resumed.items():
            want = self.losses[it]
            assert abs(loss - want) <= rel * abs(want), (it, loss, want, self.losses)


def imported_flags(checkpoint: str) -> List[str]:
    """The model flags tools/convert_from_hf.py wrote beside its import (megatron_flags.txt)."""
    import shlex

    from ..checkpoint.export.hf.importer import FLAGS_FILE

    with open(os.path.join(checkpoint, FLAGS_FILE)) as f:
        return shlex.split(f.read())


def save_tiny_hf(path: str, kind: str = "llama", seed: int = 0, **overrides) -> str:
    """A random LlamaForCausalLM / MistralForCausalLM (or MoE: MixtralForCausalLM, Qwen2MoeForCausalLM with 4
    experts, top-2) of TINY's sizes and ByteTokenizer's 257 ids, built from a transformers config (nothing
    downloaded) and saved to `path` with save_pretrained."""
    import torch
    import transformers

    config_class, model_class = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
                                 "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
                                 "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM),
                                 "qwen2_moe": (transformers.Qwen2MoeConfig, transformers.Qwen2MoeForCausalLM)}[kind]
    moe = {"mixtral": dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=32),
           "qwen2_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                             shared_expert_intermediate_size=48)}.get(kind, {})
    overrides = {**moe, **overrides}
    fields = dict(vocab_size=257, hidden_size=TINY["hidden-size"], intermediate_size=64,
                  num_hidden_layers=TINY["num-layers"], num_attention_heads=TINY["num-attention-heads"],
                  num_key_value_heads=2, max_position_embeddings=TINY["seq-length"], rms_norm_eps=1e-6,
                  rope_theta=10000.0, bos_token_id=256, eos_token_id=256, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model_class(config_class(**{**fields, **overrides})).save_pretrained(path)
    return path
