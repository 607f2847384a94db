#!/usr/bin/env python
"""Convert a checkpoint from one framework's layout to another's, tensor by tensor.

    python tools/convert_checkpoint.py --from torch_dist --to universal --input <megatron save dir or iter_N> \
        --output <dir>/iter_N_universal [--vocab-size N]
    python tools/convert_checkpoint.py --from deepspeed --to universal --input <save>/global_step10 --output <dir>
    python tools/convert_checkpoint.py --from deepspeed|universal --to torch_dist --input <checkpoint> \
        --output <megatron save dir> [--target-tp N]

The universal checkpoint is the hub: `pretrain_gpt.py --load <output> --universal-checkpoint` resumes it at any
TP x PP x DP and ZeRO stage. Megatron-LM torch_dist checkpoints also load directly (`--load`, format detected).
--to torch_dist writes <output>/iter_N/ and latest_checkpointed_iteration.txt, which Megatron-Core's
dist_checkpointing.load reads at any TP; --target-tp pads the vocabulary for that TP (Megatron's rule).
--vocab-size: the tokenizer's vocabulary, so Megatron's padded rows are dropped (default: kept).
Every pair this tool does not convert is refused in one sentence naming the pair.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_zero.checkpoint.errors import CheckpointError  # noqa: E402

FORMATS = ("deepspeed", "universal", "torch_dist", "megatron_legacy", "dcp", "hf")
SUPPORTED = {("torch_dist", "universal"), ("deepspeed", "universal"), ("deepspeed", "torch_dist"),
             ("universal", "torch_dist")}


def parse_arguments(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--from", dest="src_format", choices=FORMATS, required=True)
    p.add_argument("--to", dest="dst_format", choices=FORMATS, required=True)
    p.add_argument("--input", required=True, help="the checkpoint to convert")
    p.add_argument("--output", required=True, help="the directory to create")
    p.add_argument("--vocab-size", type=int, default=None,
                   help="torch_dist: the unpadded vocabulary (Megatron's padded rows beyond it are dropped)")
    p.add_argument("--target-tp", type=int, default=1,
                   help="--to torch_dist: the TP the vocabulary is padded for (make_vocab_size_divisible_by x TP)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    a = parse_arguments(argv)
    pair = (a.src_format, a.dst_format)
    try:
        if pair not in SUPPORTED:
            raise CheckpointError(f"--from {a.src_format} --to {a.dst_format} is not a conversion this tool makes; "
                                  f"it converts {', '.join(f'--from {s} --to {d}' for s, d in sorted(SUPPORTED))} "
                                  "(Hugging Face: tools/convert_from_hf.py and tools/convert_to_hf.py)")
        if pair == ("torch_dist", "universal"):
            from megatron_zero.checkpoint.interop.to_universal import torch_dist_to_universal
            s = torch_dist_to_universal(a.input, a.output, a.vocab_size)
            what = f"Megatron-Core torch_dist checkpoint {s['source']} (iteration {s['iteration']})"
        elif a.dst_format == "torch_dist":
            from megatron_zero.checkpoint.interop.torch_dist_write import write_torch_dist
            s = write_torch_dist(a.input, a.output, a.target_tp)
            what = f"{a.src_format} checkpoint {a.input} (iteration {s['iteration']}) as torch_dist {s['directory']}"
        else:
            from megatron_zero.checkpoint.reshape.universal_convert import convert_to_universal
            s = convert_to_universal(a.input, a.output, merge_workers=1, progress=False)
            what = f"ZeRO-{s['zero_stage']} {s['layout']} checkpoint {a.input}"
    except CheckpointError as e:
        print(f"convert_checkpoint.py: error: {e}", file=sys.stderr)
        return 2
    print(f"converted {s['params']} parameters of the {what} into {a.output} "
          f"({s['bytes'] / 2**20:.1f} MiB) in {s['seconds']:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
