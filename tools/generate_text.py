"""Sample text from any checkpoint on one process: ZeRO (any TP/PP/DP), universal, or consolidated.

    python tools/generate_text.py --load CKPT --tokenizer-model tok.model --prompt "The import statement"

--load takes a save directory (its `latest` or `latest_universal`), one checkpoint directory,
or a consolidated pytorch_model.bin / model.safetensors / safetensors index (then give
--num-attention-heads, which weights do not record). The model runs as the single-process
reference GPT with full fp32 weights.
"""
import argparse
import os
import sys

from megatron_zero.checkpoint import CheckpointError, add_verify_flag
from megatron_zero.checkpoint.deepspeed_layout import persistent_buffers
from megatron_zero.checkpoint.export.consolidate import get_fp32_state_dict, load_consolidated, resolve_checkpoint_dir
from megatron_zero.checkpoint.saved_config import saved_args, saved_config
from megatron_zero.data import DataError, build_tokenizer
from megatron_zero.generation import generate
from megatron_zero.model.gpt import reference_model
from megatron_zero.model.sharding import shard_state_dict

CONSOLIDATED = ("pytorch_model.bin", "model.safetensors", "model.safetensors.index.json")


def load_model(path: str, num_heads=None, verify: bool = True):
    """(reference model with the checkpoint's weights, the arguments it was trained with)."""
    consolidated = os.path.isfile(path) or any(os.path.isfile(os.path.join(path, c)) for c in CONSOLIDATED)
    if consolidated:
        sd, args = load_consolidated(path), {}
    else:
        directory = resolve_checkpoint_dir(path)
        sd, args = get_fp32_state_dict(directory, verify=verify), saved_args(directory, verify)
    config = saved_config(list(sd), lambda n: sd[n].shape, args, num_heads, where=path)
    config.make_vocab_size_divisible_by = int(args.get("make_vocab_size_divisible_by", 128))
    model = reference_model(config)
    buffers = persistent_buffers(model)  # the routers' expert biases: whole, not sharded
    state = shard_state_dict({n: t for n, t in sd.items() if n not in buffers}, config, 1, 0)
    model.load_state_dict({**state, **{n: sd[n] for n in buffers if n in sd}}, strict=True)
    return model, config, args


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--load", required=True)
    p.add_argument("--tokenizer-type", default=None, help="default: the one the checkpoint was trained with")
    p.add_argument("--tokenizer-model", default=None)
    p.add_argument("--vocab-file", default=None)
    p.add_argument("--merge-file", default=None)
    p.add_argument("--num-attention-heads", type=int, default=None)
    p.add_argument("--prompt", default="")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--greedy", action="store_true")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    add_verify_flag(p)
    a = p.parse_args(argv)
    try:
        model, config, args = load_model(a.load, a.num_attention_heads, a.verify_checkpoint)
        tokenizer = build_tokenizer(a.tokenizer_type or args.get("tokenizer_type", "GPTSentencePieceTokenizer"),
                                    a.tokenizer_model or args.get("tokenizer_model"),
                                    a.vocab_file or args.get("vocab_file"), a.merge_file or args.get("merge_file"),
                                    args.get("vocab_size"), args.get("tiktoken_pattern"),
                                    args.get("tiktoken_num_special_tokens", 1000), args.get("tokenizer_special_tokens"))
    except (CheckpointError, DataError, OSError) as err:
        print(f"generate_text.py: error: {err}", file=sys.stderr)
        return 2
    ids = generate(model, tokenizer.tokenize(a.prompt), a.max_new_tokens, config.vocab_size, config.seq_length,
                   temperature=a.temperature, top_k=a.top_k, top_p=a.top_p, greedy=a.greedy,
                   eod=getattr(tokenizer, "eod", None), seed=a.seed)
    print(tokenizer.detokenize(ids))
    return 0


if __name__ == "__main__":
    sys.exit(main())
