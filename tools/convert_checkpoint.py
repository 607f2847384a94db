#!/usr/bin/env python
"""Convert a checkpoint from one framework's layout to another's, one tensor (or one layer) at a time.

    python tools/convert_checkpoint.py --from FORMAT --to FORMAT --input PATH --output DIR [options]

    --from  deepspeed        our (and DeepSpeed's / Megatron-DeepSpeed's) ZeRO checkpoint, any TP x PP x DP
            universal        a universal checkpoint (tools/ds_to_universal.py, or this tool's --to universal)
            torch_dist       Megatron-Core / Megatron-LM torch_dist (a save directory or an iter_XXXXXXX one)
            megatron_legacy  Megatron-LM --ckpt-format torch (iter_XXXXXXX/mp_rank_TT[_PPP]/model_optim_rng.pt)
            dcp              a torchtitan Llama step-N directory (torch.distributed.checkpoint)
    --to    universal        the hub: pretrain_gpt.py --load DIR --universal-checkpoint resumes it at any layout
            torch_dist       DIR/iter_N + latest_checkpointed_iteration.txt, for Megatron-LM / Megatron-Core
                             (--target-tp pads the vocabulary for that TP)
            dcp              DIR/step-N in torchtitan's Llama layout

The conversions made: deepspeed | torch_dist | megatron_legacy | dcp -> universal; deepspeed | universal ->
torch_dist; deepspeed | universal | torch_dist | megatron_legacy -> dcp. Hugging Face models: tools/convert_from_hf.py
and tools/convert_to_hf.py.

--vocab-size (torch_dist, legacy): the tokenizer's vocabulary, so Megatron's padded rows are dropped (default: kept).
--num-attention-heads (dcp; required), --seq-length, --rotary-base, --norm-epsilon, --make-vocab-size-divisible-by:
what a torchtitan checkpoint does not record; --global-batch-size derives its samples consumed where it records
none. An output that holds a newer iteration, or is a megatron_zero save directory, is refused unless --force.
Anything that cannot be mapped is refused in one sentence naming it. Progress goes to stderr (--quiet: none).
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_zero.checkpoint.errors import CheckpointError  # noqa: E402
from megatron_zero.checkpoint.interop.convert import SINKS, SOURCES, pairs_text  # noqa: E402


def parse_arguments(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=f"Conversions: {pairs_text()}. "
                                "Hugging Face: tools/convert_from_hf.py, tools/convert_to_hf.py.")
    p.add_argument("--from", dest="src_format", required=True, metavar="|".join(SOURCES),
                   help="the format of --input")
    p.add_argument("--to", dest="dst_format", required=True, metavar="|".join(SINKS), help="the format to write")
    p.add_argument("--input", required=True, help="the checkpoint to convert")
    p.add_argument("--output", required=True, help="the directory to create")
    p.add_argument("--vocab-size", type=int, default=None,
                   help="torch_dist / megatron_legacy: the unpadded vocabulary (padded rows beyond it are dropped)")
    p.add_argument("--target-tp", type=int, default=1,
                   help="--to torch_dist: the TP the vocabulary is padded for (make_vocab_size_divisible_by x TP)")
    p.add_argument("--num-attention-heads", type=int, default=None, help="--from dcp: the model's head count")
    p.add_argument("--seq-length", type=int, default=2048, help="--from dcp: the sequence length trained at")
    p.add_argument("--rotary-base", type=float, default=10000, help="--from dcp: RoPE's theta")
    p.add_argument("--norm-epsilon", type=float, default=1e-5, help="--from dcp: RMSNorm's epsilon")
    p.add_argument("--make-vocab-size-divisible-by", type=int, default=128,
                   help="--from dcp: the padding rule the runs that load the result use")
    p.add_argument("--global-batch-size", type=int, default=None,
                   help="--from dcp: the run's global batch, so the samples consumed are iteration x it where the "
                        "checkpoint records none (torchtitan's own records none)")
    p.add_argument("--force", action="store_true",
                   help="write even where --output holds a newer iteration or is a megatron_zero save directory "
                        "(the checkpoint pointer there then names the converted iteration)")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    return p.parse_args(argv)


def main(argv=None) -> int:
    a = parse_arguments(argv)
    try:
        from megatron_zero.checkpoint.interop.convert import convert
        titan = {k: getattr(a, k) for k in ("num_attention_heads", "seq_length", "rotary_base", "norm_epsilon",
                                            "make_vocab_size_divisible_by")} if a.src_format == "dcp" else {}
        s = convert(a.src_format, a.dst_format, a.input, a.output, a.vocab_size, a.target_tp, force=a.force,
                    progress=not a.quiet, global_batch_size=a.global_batch_size, **titan)
    except CheckpointError as e:
        print(f"convert_checkpoint.py: error: {e}", file=sys.stderr)
        return 2
    if s.get("consumed"):
        print(f"data position: {s['consumed']}")
    rate = s["bytes"] / 2**20 / s["seconds"] if s["seconds"] > 0 else 0.0
    print(f"converted {s['params']} parameters ({s['tensors']} tensors; {a.src_format} -> {a.dst_format}, iteration "
          f"{s.get('iteration', 0)}) from {a.input} into {s.get('directory', a.output)} ({s['bytes'] / 2**20:.1f} MiB) "
          f"in {s['seconds']:.1f} s, {rate:.1f} MiB/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
