"""Megatron-LM flags taken as documented no-ops: each asks for what happens here anyway, says so in --help and in
docs/coming_from_megatron.md, and is refused where it would be ignored (one sentence). Registered in
arguments.FEATURES; the older no-ops are in compat_flags.py."""
from __future__ import annotations

import argparse

from .config.errors import require


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


def add_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("Megatron-LM flags that change nothing here (docs/coming_from_megatron.md)")
    for flag, meaning in SWITCHES.items():
        g.add_argument(flag, action="store_true", help=f"no-op: {meaning}")
    g.add_argument("--no-bias-dropout-fusion", dest="bias_dropout_fusion", action="store_false",
                   help="no-op: the bias, dropout and residual add run as separate PyTorch ops here (no fused kernel)")
    g.add_argument("--dataloader-type", choices=("single",), default="single",
                   help="single (Megatron-LM's default): each global batch is the next samples of the shuffled "
                        "dataset, the only sampler here")


def check(args) -> None:
    require(not (args.accumulate_allreduce_grads_in_fp32 and args.grad_reduce_in_bf16),
            "--accumulate-allreduce-grads-in-fp32 and --grad-reduce-in-bf16 ask for opposite gradient reductions; "
            "give one of them")
