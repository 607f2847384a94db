#!/usr/bin/env python
"""Write a Hugging Face GPT2LMHeadModel directory (config.json + model.safetensors) from any of our checkpoints.

    python tools/convert_to_hf.py <save> <hf_dir> [-t TAG] [--num-attention-heads N]
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_zero.checkpoint.errors import CheckpointError  # noqa: E402
from megatron_zero.checkpoint.reader import add_verify_flag  # noqa: E402
from megatron_zero.checkpoint.hf_export import convert_checkpoint_to_hf  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("checkpoint_dir", help="save directory (holding `latest`), a checkpoint or a universal checkpoint")
    p.add_argument("output_dir")
    p.add_argument("-t", "--tag", default=None)
    p.add_argument("--num-attention-heads", type=int, default=None,
                   help="needed only when the checkpoint's args do not record it")
    add_verify_flag(p)
    a = p.parse_args(argv)
    try:
        cfg = convert_checkpoint_to_hf(a.checkpoint_dir, a.output_dir, a.num_attention_heads, a.tag,
                                       verify=a.verify_checkpoint)
    except (CheckpointError, ValueError, KeyError) as e:
        print(f"convert_to_hf.py: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote GPT2LMHeadModel ({cfg.num_layers} layers, hidden {cfg.hidden_size}, vocab {cfg.vocab_size}) "
          f"to {a.output_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
