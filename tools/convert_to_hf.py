#!/usr/bin/env python
"""Write a Hugging Face model directory (config.json, generation_config.json, safetensors) from any of our checkpoints.

    python tools/convert_to_hf.py <save> <hf_dir> [-t TAG] [--dtype fp32|bf16|fp16] [--max-shard-size 5GB]

Architectures: those in megatron_zero/checkpoint/hf/ (the checkpoint's model picks one; --architecture
overrides). Weights stream out one parameter at a time: memory is about one parameter, never the model.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_zero.checkpoint.errors import CheckpointError  # noqa: E402
from megatron_zero.checkpoint.export.hf import ARCHITECTURES  # noqa: E402
from megatron_zero.checkpoint.export.hf.exporter import DTYPES, export_hf  # noqa: E402
from megatron_zero.checkpoint.storage.reader import add_verify_flag  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("checkpoint_dir", help="save directory (holding `latest`), a checkpoint or a universal checkpoint")
    p.add_argument("output_dir")
    p.add_argument("-t", "--tag", default=None)
    p.add_argument("--dtype", choices=list(DTYPES), default="fp32", help="the exported weights' dtype")
    p.add_argument("--max-shard-size", default="5GB", help="largest safetensors file, like 500MB or 5GB")
    p.add_argument("--architecture", choices=list(ARCHITECTURES), default=None,
                   help="default: the architecture the checkpoint's model is")
    p.add_argument("--num-attention-heads", type=int, default=None,
                   help="needed only when the checkpoint's args do not record it")
    p.add_argument("--progress", action="store_true", help="a progress line on stderr")
    add_verify_flag(p)
    a = p.parse_args(argv)
    try:
        out = export_hf(a.checkpoint_dir, a.output_dir, a.dtype, a.max_shard_size, a.architecture,
                        a.num_attention_heads, a.tag, a.progress, verify=a.verify_checkpoint)
    except (CheckpointError, ValueError, KeyError) as e:
        print(f"convert_to_hf.py: error: {e}", file=sys.stderr)
        return 2
    cfg = out["config"]
    print(f"wrote {out['architecture']} ({cfg.num_layers} layers, hidden {cfg.hidden_size}, vocab {cfg.vocab_size}, "
          f"{a.dtype}) to {a.output_dir}: {', '.join(out['files'])}")
    if out["dropped"]:
        print(f"left out {len(out['dropped'])} parameters of the multi-token prediction depths ({out['dropped'][0]}, "
              f"...): {out['architecture']} has no MTP layers")
    return 0


if __name__ == "__main__":
    sys.exit(main())
