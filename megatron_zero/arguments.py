"""Megatron's command-line flags, parsed and validated up front.

Every inconsistency is refused with one sentence naming the flags and values
(ArgumentError); `parse_args` prints that sentence and exits 2, no traceback.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import List, Optional

from .checkpoint.reader import add_verify_flag
from .deepspeed_config import DeepSpeedConfigError, apply_deepspeed_config


class ArgumentError(ValueError):
    """A flag or combination of flags that cannot work (one sentence)."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, no usage dump
        raise ArgumentError(f"{message} (see --help)")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="pretrain_gpt.py", description="Pretrain a GPT with TP x PP x ZeRO-DP.")
    g = p.add_argument_group("model")
    g.add_argument("--num-layers", type=int, required=True)
    g.add_argument("--hidden-size", type=int, required=True)
    g.add_argument("--num-attention-heads", type=int, required=True)
    g.add_argument("--ffn-hidden-size", type=int, default=None)
    g.add_argument("--seq-length", type=int, required=True)
    g.add_argument("--max-position-embeddings", type=int, default=None)
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    g.add_argument("--hidden-dropout", type=float, default=0.1)
    g.add_argument("--attention-dropout", type=float, default=0.1)
    g.add_argument("--layernorm-epsilon", type=float, default=1e-5)
    g.add_argument("--init-method-std", type=float, default=0.02)

    g = p.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-partition-method", choices=["uniform", "parameters"], default="uniform")
    g.add_argument("--pipeline-partition", type=str, default=None,
                   help="explicit transformer layers per pipeline stage, e.g. 3,5")
    g.add_argument("--micro-batch-size", type=int, default=None)
    g.add_argument("--global-batch-size", type=int, default=None)
    g.add_argument("--zero-stage", type=int, default=1, choices=[0, 1, 2, 3])
    g.add_argument("--cpu-optimizer", "--zero-cpu-offload", dest="offload", action="store_const", const="cpu",
                   default="none", help="keep fp32 masters and Adam state in host memory (ZeRO-Offload)")
    g.add_argument("--zero-param-persistence-threshold", type=int, default=100_000,
                   help="ZeRO-3: parameters of at most this many elements stay gathered (DeepSpeed's "
                        "stage3_param_persistence_threshold; 0 gathers every parameter per layer)")
    g.add_argument("--zero-nvme-offload-path", type=str, default=None,
                   help="keep optimizer state in files under this path (ZeRO-Infinity style)")
    g.add_argument("--deepspeed-config", "--deepspeed_config", dest="deepspeed_config", type=str, default=None)
    g.add_argument("--distributed-backend", choices=["gloo", "nccl"], default=None)
    g.add_argument("--distributed-timeout-minutes", type=float, default=10.0)

    g = p.add_argument_group("training")
    g.add_argument("--train-iters", type=int, default=None)
    g.add_argument("--train-samples", type=int, default=None)
    g.add_argument("--lr", type=float, default=None)
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument("--lr-decay-style", choices=["constant", "linear", "cosine"], default="linear")
    g.add_argument("--lr-decay-iters", type=int, default=None)
    g.add_argument("--lr-warmup-iters", type=int, default=0)
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--clip-grad", type=float, default=1.0)
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.999)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--bf16", action="store_true")
    g.add_argument("--fp16", action="store_true")
    g.add_argument("--loss-scale", type=float, default=None, help="static loss scale (fp16); default dynamic")
    g.add_argument("--initial-loss-scale", type=float, default=2.0 ** 16)
    g.add_argument("--loss-scale-window", type=int, default=1000)
    g.add_argument("--min-loss-scale", type=float, default=1.0)
    g.add_argument("--hysteresis", type=int, default=2)
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--exit-interval", type=int, default=None)
    g.add_argument("--exit-duration-in-mins", type=float, default=None)
    g.add_argument("--exit-signal-handler", action="store_true")

    g = p.add_argument_group("fusions")
    g.add_argument("--no-masked-softmax-fusion", dest="masked_softmax_fusion", action="store_false")
    g.add_argument("--no-bias-gelu-fusion", dest="bias_gelu_fusion", action="store_false")
    g.add_argument("--no-persist-layer-norm", dest="persist_layer_norm", action="store_false")
    g.add_argument("--no-gradient-accumulation-fusion", dest="gradient_accumulation_fusion",
                   action="store_false")

    g = p.add_argument_group("data")
    g.add_argument("--data-path", nargs="*", default=None)
    g.add_argument("--split", type=str, default="969,30,1")
    g.add_argument("--data-cache-path", type=str, default=None)
    g.add_argument("--tokenizer-type", type=str, default="SentencePieceTokenizer")
    g.add_argument("--tokenizer-model", type=str, default=None)
    g.add_argument("--vocab-file", type=str, default=None)
    g.add_argument("--merge-file", type=str, default=None)
    g.add_argument("--vocab-size", type=int, default=None, help="for NullTokenizer")

    g = p.add_argument_group("checkpointing and logging")
    g.add_argument("--save", type=str, default=None)
    g.add_argument("--load", type=str, default=None)
    g.add_argument("--save-interval", type=int, default=None)
    g.add_argument("--keep-last-k", type=int, default=None)
    g.add_argument("--async-save", action="store_true")
    g.add_argument("--universal-checkpoint", action="store_true")
    g.add_argument("--no-load-optim", action="store_true")
    g.add_argument("--no-load-rng", action="store_true")
    g.add_argument("--finetune", action="store_true")
    g.add_argument("--overwrite-checkpoints", action="store_true",
                   help="start from scratch even though --save holds checkpoints (they are overwritten)")
    add_verify_flag(g)
    g.add_argument("--eval-interval", type=int, default=1000)
    g.add_argument("--eval-iters", type=int, default=10)
    g.add_argument("--log-interval", type=int, default=100)
    g.add_argument("--tensorboard-dir", type=str, default=None)
    return p


def explicit_flags(args) -> set:
    """Destinations whose value differs from the parser's default (given on the command line)."""
    parser = build_parser()
    return {dest for dest, value in vars(args).items() if value != parser.get_default(dest)}


def _require(cond: bool, sentence: str):
    if not cond:
        raise ArgumentError(sentence)


def validate_args(args, world_size: int):
    """Fill derived values (dp size, max positions, ...) and refuse inconsistencies."""
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    for flag in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "num_layers", "hidden_size",
                 "num_attention_heads", "seq_length"):
        value = getattr(args, flag)
        _require(value >= 1, f"--{flag.replace('_', '-')} must be at least 1, got {value}")
    _require(world_size % (tp * pp) == 0,
             f"world size {world_size} is not divisible by --tensor-model-parallel-size {tp} x "
             f"--pipeline-model-parallel-size {pp}")
    args.world_size = world_size
    args.data_parallel_size = dp = world_size // (tp * pp)
    if args.deepspeed_config:
        try:
            apply_deepspeed_config(args, args.deepspeed_config, explicit_flags(args))
        except DeepSpeedConfigError as err:
            raise ArgumentError(str(err)) from None
    _require(args.micro_batch_size is not None, "--micro-batch-size is required")
    if args.global_batch_size is None:
        args.global_batch_size = args.micro_batch_size * dp
    mb, gbs = args.micro_batch_size, args.global_batch_size
    _require(mb >= 1 and gbs >= 1, f"--micro-batch-size {mb} and --global-batch-size {gbs} must be positive")
    _require(gbs % (mb * dp) == 0,
             f"--global-batch-size {gbs} is not divisible by --micro-batch-size {mb} x data-parallel size {dp} "
             f"(world {world_size} / (TP {tp} x PP {pp}))")
    args.num_micro_batches = gbs // (mb * dp)
    _require(args.num_attention_heads % tp == 0,
             f"--num-attention-heads {args.num_attention_heads} is not divisible by "
             f"--tensor-model-parallel-size {tp}")
    _require(args.hidden_size % args.num_attention_heads == 0,
             f"--hidden-size {args.hidden_size} is not divisible by --num-attention-heads {args.num_attention_heads}")
    if args.ffn_hidden_size is None:
        args.ffn_hidden_size = 4 * args.hidden_size
    _require(args.ffn_hidden_size % tp == 0,
             f"--ffn-hidden-size {args.ffn_hidden_size} is not divisible by --tensor-model-parallel-size {tp}")
    _require(args.num_layers >= pp,
             f"--num-layers {args.num_layers} is fewer than --pipeline-model-parallel-size {pp}; "
             "every stage needs at least one layer")
    _require(pp == 1 or args.num_micro_batches >= pp,
             f"{args.num_micro_batches} micro-batches per step (--global-batch-size {gbs} / (--micro-batch-size "
             f"{mb} x DP {dp})) is fewer than --pipeline-model-parallel-size {pp}; the pipeline would idle")
    if args.pipeline_partition:
        try:
            counts = [int(x) for x in args.pipeline_partition.split(",")]
        except ValueError:
            counts = []
        _require(len(counts) == pp and min(counts) >= 1 and sum(counts) == args.num_layers,
                 f"--pipeline-partition {args.pipeline_partition} must list {pp} positive layer counts "
                 f"(one per stage of --pipeline-model-parallel-size) summing to --num-layers {args.num_layers}")
        args.pipeline_partition = counts
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    _require(args.seq_length <= args.max_position_embeddings,
             f"--seq-length {args.seq_length} is longer than --max-position-embeddings "
             f"{args.max_position_embeddings}")
    _require(not (args.fp16 and args.bf16), "--fp16 and --bf16 cannot both be given; choose one")
    _require((args.train_iters is None) != (args.train_samples is None),
             "give exactly one of --train-iters and --train-samples")
    if args.train_samples is not None:
        args.train_iters = -(-args.train_samples // gbs)
    _require(args.train_iters >= 0, f"--train-iters {args.train_iters} must not be negative")
    _require(args.lr is not None and args.lr > 0, "--lr is required and must be positive")
    _require(0 <= args.min_lr <= args.lr, f"--min-lr {args.min_lr} must lie between 0 and --lr {args.lr}")
    _require(args.lr_warmup_iters >= 0, f"--lr-warmup-iters {args.lr_warmup_iters} must not be negative")
    if args.lr_decay_iters is None:
        args.lr_decay_iters = args.train_iters
    for name in ("adam_beta1", "adam_beta2"):
        value = getattr(args, name)
        _require(0 <= value < 1, f"--{name.replace('_', '-')} {value} must lie in [0, 1)")
    _require(args.clip_grad >= 0, f"--clip-grad {args.clip_grad} must not be negative (0 disables clipping)")
    _require(args.save_interval is None or args.save_interval >= 1,
             f"--save-interval {args.save_interval} must be at least 1")
    _require(args.save_interval is None or args.save,
             "--save-interval is given without --save; say where checkpoints go")
    _require(args.keep_last_k is None or args.keep_last_k >= 1, f"--keep-last-k {args.keep_last_k} must be >= 1")
    _require(args.log_interval >= 1 and args.eval_interval >= 1,
             "--log-interval and --eval-interval must be at least 1")
    _require(args.eval_iters >= 0, f"--eval-iters {args.eval_iters} must not be negative")
    _require(args.zero_stage < 3 or pp == 1,
             f"--zero-stage 3 partitions parameters across data-parallel ranks and cannot be combined with "
             f"--pipeline-model-parallel-size {pp}; use --zero-stage 1 or 2 with pipelining")
    _require(args.zero_param_persistence_threshold >= 0,
             f"--zero-param-persistence-threshold {args.zero_param_persistence_threshold} must not be negative")
    if args.zero_nvme_offload_path:
        args.offload = "nvme"
    _require(args.offload == "none" or args.zero_stage >= 1,
             f"optimizer offload ({args.offload}) needs --zero-stage 1, 2 or 3, not {args.zero_stage}")
    if args.load:
        _require(os.path.isdir(args.load), f"--load {args.load} is not a directory")
    if args.data_path:
        _check_data_path(args.data_path)
    args.params_dtype = "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32"
    return args


def _check_data_path(data_path: List[str]):
    """--data-path is either one or more prefixes, or weight/prefix pairs."""
    if len(data_path) == 1:
        return
    first_is_number = _is_number(data_path[0])
    if first_is_number:
        _require(len(data_path) % 2 == 0,
                 f"--data-path with weights needs weight/prefix pairs, got {len(data_path)} values")
        for weight in data_path[0::2]:
            _require(_is_number(weight) and float(weight) > 0,
                     f"--data-path weight {weight!r} is not a positive number")


def _is_number(text: str) -> bool:
    try:
        float(text)
        return True
    except ValueError:
        return False


def parse_args(argv: Optional[List[str]] = None, world_size: int = 1):
    """Parse and validate; on bad input print one sentence to stderr and exit 2."""
    try:
        args = build_parser().parse_args(argv)
        return validate_args(args, world_size)
    except ArgumentError as err:
        print(f"pretrain_gpt.py: error: {err}", file=sys.stderr)
        raise SystemExit(2)


def args_to_dict(args) -> dict:
    """The arguments as a plain dict (JSON-able values), for checkpoints."""
    return {k: v for k, v in vars(args).items() if isinstance(v, (int, float, str, bool, list, type(None)))}
