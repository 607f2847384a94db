"""--compile-layers: each transformer layer's forward compiled by torch.compile (inductor), one layer at a time.

A model converter (megatron_zero/model/converters.py; megatron_zero/model_converters.py orders them), applied
last, after the converters that change what a layer computes (FP8), as torchtitan compiles each TransformerBlock
after float8. The layer's `forward` is replaced by its compiled version on the instance: the module, its parameters and their names stay as they
were (the optimizer, ZeRO-3's gather/release hooks on the layer and the checkpoint see the uncompiled
layer), and those module hooks, activation recomputation around the layers and the pipeline schedule stay
eager around the compiled forward.

Left to eager inside a compiled layer (torch.compiler.disable, ops/eager.py):
- the fused kernels (megatron_zero/ops), C++/CUDA extensions inductor cannot trace: each runs between the
  compiled pieces, where its fusion flag and the device pick it (named once in the converter's log line);
- the tensor-parallel collectives (TP/SP's conjugate pairs, the asynchronous gradient all-reduce), which may
  go through the shared-memory transport (distributed/shm_comm.py) that dynamo must not trace;
- an MoE layer's router and expert dispatch: its token counts per expert are data-dependent shapes that
  would recompile every step; the layer's attention and norms compile (named in the log line).
Context parallelism's attention exchange runs eagerly at a graph break where dynamo cannot trace it.
Each rank compiles into its own inductor cache directory (TORCHINDUCTOR_CACHE_DIR, or inductor's default, with
`rank<N>` below it): inductor's C++ builder writes a layer's `.so` in place under a name made from the code, so
two ranks of one host compiling the same layer would write and load the same file at once.
With dropout on, inductor draws its random numbers as eager PyTorch does (torch._inductor.config.fallback_random),
so the masks come from the same generators (the RNG tracker's per-TP-rank stream included) and a recomputed
layer replays them.
"""
from __future__ import annotations

import os
from typing import List

import torch

from ..model.converters import ModelConverter
from ..ops.fusion_flags import get_fusion_flags
from ..ops.registry import extension_for

# (the fusion flags that turn it on, the kernel's name in ops/registry.py): the kernels a transformer layer calls
# (the causal softmax also by query blocks, model/block_causal_attention.py)
LAYER_KERNELS = ((("bias_gelu_fusion",), "bias_gelu"),
                 (("masked_softmax_fusion",), "scaled_upper_triang_masked_softmax"),
                 (("layer_norm_fusion", "persist_layer_norm"), "layer_norm"),
                 (("layer_norm_fusion", "persist_layer_norm"), "rms_norm"), (("rope_fusion",), "rope"))


def eager_kernels(device: torch.device) -> List[str]:
    """The fused kernels a layer on `device` calls under the run's fusion flags (each left to eager)."""
    probe = torch.empty(0, device=device)
    flags = get_fusion_flags()
    return sorted({kernel for names, kernel in LAYER_KERNELS
                   if all(getattr(flags, n) for n in names) and extension_for(kernel, probe) is not None})


def own_build_directory() -> str:
    """Point inductor's cache (its C++ builds included) at a directory of this rank's own; -> the directory."""
    import torch.distributed as dist
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    base = os.environ.get("TORCHINDUCTOR_CACHE_DIR") or default_cache_dir()
    mine = f"rank{dist.get_rank()}" if dist.is_available() and dist.is_initialized() else None
    if mine and os.path.basename(os.path.normpath(base)) != mine:
        base = os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(base, mine)
    return base


class CompileLayersConverter(ModelConverter):
    """Compile each transformer layer's forward of a built stage (a model converter); -> the log line."""

    name = "compile"

    def __init__(self, device: torch.device, mode: str = "default", fullgraph: bool = False):
        self.device, self.mode, self.fullgraph = device, mode, fullgraph

    def convert(self, model: torch.nn.Module) -> str:
        own_build_directory()
        blocks = list(model.blocks)
        config = getattr(model, "config", None)
        if config is not None and (config.hidden_dropout > 0 or config.attention_dropout > 0):
            import torch._inductor.config as inductor_config
            inductor_config.fallback_random = True  # eager's dropout masks (see the module docstring)
        moe = 0
        for block in blocks:
            mlp = getattr(block, "mlp", None)
            if type(mlp).__name__ == "MoELayer":
                mlp.forward = torch.compiler.disable(mlp.forward)
                moe += 1
            block.forward = torch.compile(block.forward, mode=None if self.mode == "default" else self.mode,
                                          fullgraph=self.fullgraph)
        kernels = eager_kernels(self.device)
        eager = [f"the fused kernels {', '.join(kernels)} (where a layer calls them)"] if kernels else []
        if moe:
            eager.append(f"the router and expert dispatch of {moe} MoE layers")
        left = f"; left to eager inside them: {'; '.join(eager)}" if eager else ""
        return (f"compiled layers: {len(blocks)} transformer layers compiled one by one (torch.compile, inductor, "
                f"mode {self.mode}){left}")
