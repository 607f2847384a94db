"""Where and how each rank runs: the device, the communication backend and its timeout, shared-memory
collectives, and the fused kernels' switches."""
from __future__ import annotations

import argparse

from .errors import require


def add_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("devices, communication and fused kernels")
    g.add_argument("--distributed-backend", choices=["gloo", "nccl"], default=None,
                   help="default: nccl on CUDA, gloo on the CPU")
    g.add_argument("--no-shared-memory-all-reduce", dest="shared_memory_all_reduce", action="store_false",
                   help="all-reduces and pipeline sends of host tensors through gloo even where all ranks of the "
                        "group share one host (default there: through shared memory, megatron_zero/shm_comm.py, "
                        "megatron_zero/pipeline/shm_p2p.py)")
    g.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto",
                   help="where each rank trains: cuda:LOCAL_RANK when CUDA is present (auto), or forced")
    g.add_argument("--no-cuda", dest="device", action="store_const", const="cpu",
                   help="train on the CPU even where CUDA is present (same as --device cpu)")
    g.add_argument("--distributed-timeout-minutes", type=float, default=10.0,
                   help="how long a collective may wait for the other ranks before the run fails")
    g.add_argument("--no-masked-softmax-fusion", dest="masked_softmax_fusion", action="store_false",
                   help="use the unfused causal softmax instead of the fused kernel")
    g.add_argument("--no-bias-gelu-fusion", dest="bias_gelu_fusion", action="store_false",
                   help="use the unfused bias + GeLU instead of the fused kernel")
    g.add_argument("--no-persist-layer-norm", dest="persist_layer_norm", action="store_false",
                   help="use the unfused LayerNorm instead of the fused kernel")
    g.add_argument("--no-rope-fusion", dest="rope_fusion", action="store_false",
                   help="use the unfused RoPE instead of the fused kernel")
    g.add_argument("--no-gradient-accumulation-fusion", dest="gradient_accumulation_fusion",
                   action="store_false",
                   help="accumulate weight gradients through autograd instead of straight into the fp32 gradient buffer")
    g.add_argument("--require-fused-kernels", action="store_true",
                   help="refuse to start unless every compiled kernel the chosen device uses is built and loads "
                        "(CUDA: megatron_zero._C_cuda; CPU: the C++ CPU kernels; with offload also the CPU Adam)")


def check(args) -> None:
    require(not (args.device == "cpu" and args.distributed_backend == "nccl"),
            "--distributed-backend nccl needs GPUs but --device cpu was given; use --distributed-backend gloo")

