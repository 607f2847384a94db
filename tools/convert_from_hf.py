#!/usr/bin/env python
"""Import a local Hugging Face model directory as a checkpoint that `--load` reads at any layout.

    python tools/convert_from_hf.py --input-dir HF_DIR --output-dir CKPT \\
        [--tensor-model-parallel-size T --pipeline-model-parallel-size P]

HF_DIR holds config.json and safetensors or pytorch_model.bin weights (one file or sharded with an
index); nothing is downloaded. CKPT is a weights-only universal checkpoint: `--load CKPT` starts
from these weights with a fresh optimizer at iteration 0 (`--finetune` semantics), on any TP x PP x
DP and ZeRO stage. T and P are checked against the model (heads and FFN divisible by T, P at most
the layer count) and go into the printed flags; the files themselves do not depend on them. The
flags that build this model are printed and written to CKPT/megatron_flags.txt.
"""
import argparse
import os
import shlex
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_zero.checkpoint.errors import CheckpointError  # noqa: E402
from megatron_zero.checkpoint.export.hf.importer import import_hf  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--input-dir", required=True, help="a local Hugging Face model directory")
    p.add_argument("--output-dir", required=True, help="the checkpoint to write (must not exist)")
    p.add_argument("--tensor-model-parallel-size", type=int, default=1)
    p.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    p.add_argument("--apply-layernorm-1p", action="store_true",
                   help="hold the norm weights zero-centred (w = gamma - 1), for training with --apply-layernorm-1p")
    a = p.parse_args(argv)
    try:
        out = import_hf(a.input_dir, a.output_dir, a.tensor_model_parallel_size, a.pipeline_model_parallel_size,
                        a.apply_layernorm_1p)
    except (CheckpointError, ValueError) as e:
        print(f"convert_from_hf.py: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out['architecture']} ({out['params']} parameters, {out['bytes'] / 2**20:.1f} MiB) to "
          f"{a.output_dir} in {out['seconds']:.1f} s; train it with --load {a.output_dir} and:")
    print(shlex.join(out["flags"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
