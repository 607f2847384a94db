"""Where and how each rank runs: the device, the communication backend and its timeout, shared-memory
collectives, and the fused kernels' switches."""
from __future__ import annotations

import argparse
from typing import Optional

from .errors import require
from .fields import add_section_flags, flag, section


@section("devices, communication and fused kernels")
class RuntimeConfig:
    """Where and how each rank runs: the device, the backend and its timeout, shared memory, the fused kernels."""
    distributed_backend: Optional[str] = flag("default: nccl on CUDA, gloo on the CPU", choices=["gloo", "nccl"])
    shared_memory_all_reduce: bool = flag(
        "all-reduces and pipeline sends of host tensors through gloo even where all ranks of the group share one host "
        "(default there: through shared memory, megatron_zero/distributed/shm_comm.py, megatron_zero/pipeline/shm_p2p.py)", True,
        names=("--no-shared-memory-all-reduce",), action="store_false")
    device: str = flag("where each rank trains: cuda:LOCAL_RANK when CUDA is present (auto), or forced", "auto",
                       choices=["auto", "cuda", "cpu"],
                       also=(dict(names=("--no-cuda",), action="store_const", const="cpu",
                                  help="train on the CPU even where CUDA is present (same as --device cpu)"),))
    distributed_timeout_minutes: float = flag("how long a collective may wait for the other ranks before the run "
                                              "fails", 10.0)
    masked_softmax_fusion: bool = flag("use the unfused causal softmax instead of the fused kernel", True,
                                       names=("--no-masked-softmax-fusion",), action="store_false")
    bias_gelu_fusion: bool = flag("use the unfused bias + GeLU instead of the fused kernel", True,
                                  names=("--no-bias-gelu-fusion",), action="store_false")
    persist_layer_norm: bool = flag("use the unfused LayerNorm instead of the fused kernel", True,
                                    names=("--no-persist-layer-norm",), action="store_false")
    rope_fusion: bool = flag("use the unfused RoPE instead of the fused kernel", True, names=("--no-rope-fusion",),
                             action="store_false")
    gradient_accumulation_fusion: bool = flag(
        "accumulate weight gradients through autograd instead of straight into the fp32 gradient buffer", True,
        names=("--no-gradient-accumulation-fusion",), action="store_false")
    memory_plan_check: bool = flag(
        "start on a GPU even where the planner (tools/plan.py) predicts a peak above the device's memory (default: "
        "refuse in one sentence naming the largest parts and layouts that fit)", True,
        names=("--no-memory-plan-check",), action="store_false")
    require_fused_kernels: bool = flag(
        "refuse to start unless every compiled kernel the chosen device uses is built and loads (CUDA: "
        "megatron_zero._C_cuda; CPU: the C++ CPU kernels; with offload also the CPU Adam)", False, action="store_true")


def add_flags(p: argparse.ArgumentParser) -> None:
    add_section_flags(p, RuntimeConfig)


def check(args) -> None:
    require(not (args.device == "cpu" and args.distributed_backend == "nccl"),
            "--distributed-backend nccl needs GPUs but --device cpu was given; use --distributed-backend gloo")

