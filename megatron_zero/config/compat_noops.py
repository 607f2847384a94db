"""Megatron-LM flags taken as documented no-ops: each asks for what happens here anyway, says so in --help and in
docs/coming_from_megatron.md, and is refused where it would be ignored (one sentence). A feature section
(arguments.FEATURES); the older no-ops are CompatConfig's (compat.py)."""
from __future__ import annotations

import argparse

from .errors import require
from .fields import add_section_flags, flag, section

# switch -> what happens here anyway (its --help says "no-op: " and this)
SWITCHES = {
    "--attention-softmax-in-fp32": "the attention softmax runs in fp32 here whatever the training dtype",
    "--accumulate-allreduce-grads-in-fp32": "gradients are accumulated and reduced in fp32 here (refused with "
                                            "--grad-reduce-in-bf16, which asks for the opposite)",
    "--disable-jit-fuser": "no TorchScript fuser is used here",
    "--auto-detect-ckpt-format": "the format of the Megatron-LM checkpoint --load names is detected here without "
                                 "--ckpt-format",
    "--use-pytorch-profiler": "--profile's trace is torch.profiler's here",
}


def _noop(name: str):
    return flag(f"no-op: {SWITCHES[name]}", False, action="store_true")


@section("Megatron-LM flags that change nothing here (docs/coming_from_megatron.md)")
class CompatNoopsConfig:
    """Switches that ask for what happens here anyway."""
    attention_softmax_in_fp32: bool = _noop("--attention-softmax-in-fp32")
    accumulate_allreduce_grads_in_fp32: bool = _noop("--accumulate-allreduce-grads-in-fp32")
    disable_jit_fuser: bool = _noop("--disable-jit-fuser")
    auto_detect_ckpt_format: bool = _noop("--auto-detect-ckpt-format")
    use_pytorch_profiler: bool = _noop("--use-pytorch-profiler")
    bias_dropout_fusion: bool = flag("no-op: the bias, dropout and residual add run as separate PyTorch ops here (no "
                                     "fused kernel)", True, names=("--no-bias-dropout-fusion",), action="store_false")
    dataloader_type: str = flag("single (Megatron-LM's default): each global batch is the next samples of the "
                                "shuffled dataset, the only sampler here", "single", choices=["single"])


def add_flags(p: argparse.ArgumentParser) -> None:
    add_section_flags(p, CompatNoopsConfig)


def check(args) -> None:
    require(not (args.accumulate_allreduce_grads_in_fp32 and args.grad_reduce_in_bf16),
            "--accumulate-allreduce-grads-in-fp32 and --grad-reduce-in-bf16 ask for opposite gradient reductions; "
            "give one of them")
