"""--compile-layers and --compile-mode: torch.compile of each transformer layer (compile/layers.py).

Megatron-LM has no such flag; the meaning is torchtitan's (its compile of each TransformerBlock), spelled as
Megatron's flags are. Refused in one sentence: --compile-mode without --compile-layers (it would be ignored),
and the modes that capture CUDA graphs (reduce-overhead, max-autotune) with ZeRO-3, which gathers each
layer's weights into new memory at every forward where a CUDA graph replays fixed addresses.
"""
from __future__ import annotations

import argparse

from .errors import require
from .fields import add_section_flags, flag, section


# torch.compile's modes (compile/layers.py passes the one given)
MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


@section("compiled layers (torch.compile of each transformer layer; docs/compile.md)")
class CompileConfig:
    """Whether and how each transformer layer is compiled, checked."""
    compile_layers: bool = flag("compile each transformer layer's forward with torch.compile (inductor), one layer "
                                "at a time as torchtitan does; the embedding, output layer, loss, pipeline schedule, "
                                "ZeRO and recomputation stay eager around them; the fused kernels run eagerly "
                                "between the compiled pieces", False, action="store_true")
    compile_mode: str = flag("torch.compile's mode for --compile-layers (reduce-overhead adds CUDA graphs)", "default",
                             choices=MODES)


def add_flags(p: argparse.ArgumentParser) -> None:
    add_section_flags(p, CompileConfig)


def check(args) -> None:
    """Refuse, in one sentence (ArgumentError), what compiled layers cannot do with the other flags."""
    if not args.compile_layers:
        require(args.compile_mode == "default",
                f"--compile-mode {args.compile_mode} sets how --compile-layers compiles; give --compile-layers "
                "or drop it")
        return
    require(args.zero_stage != 3 or args.compile_mode in ("default", "max-autotune-no-cudagraphs"),
            f"--compile-mode {args.compile_mode} with --zero-stage 3: its CUDA graphs replay fixed weight "
            "addresses, and ZeRO-3 gathers each layer's weights into new memory at every forward; use "
            "--compile-mode default or max-autotune-no-cudagraphs")
