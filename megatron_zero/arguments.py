"""Megatron's command-line flags, parsed and validated up front.

Every inconsistency is refused with one sentence naming the flags and values
(ArgumentError); `parse_args` prints that sentence and exits 2, no traceback.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys
from typing import List, Optional

import torch

from .batch_schedule import BatchScheduleError, check_reachable, schedule_from_args
from .checkpoint.storage.reader import add_verify_flag
from .compat_flags import CompatError, add_compat_flags, validate_compat
from .deepspeed_config import DeepSpeedConfigError, apply_deepspeed_config
from .flag_refusals import refusals, unknown_flag_sentence
from .moe.core_router_flags import add_core_router_flags, check_core_router_flags
from .fp8.flags import add_fp8_flags, check_fp8_flags
from .moe.flags import DeepSpeedMoEError, add_deepspeed_moe_flags, apply_deepspeed_moe_flags
from .model.config import NORMALIZATIONS, POSITION_EMBEDDING_TYPES, default_ffn_hidden_size


class ArgumentError(ValueError):
    """A flag or combination of flags that cannot work (one sentence)."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, no usage dump
        raise ArgumentError(f"{message} (see --help)")


def _normalization(text: str) -> str:
    """LayerNorm or RMSNorm, in any case (Megatron-DeepSpeed writes layernorm / rmsnorm)."""
    by_lower = {n.lower(): n for n in NORMALIZATIONS}
    if text.lower() not in by_lower:
        raise argparse.ArgumentTypeError(f"{text!r} is not one of {', '.join(NORMALIZATIONS)}")
    return by_lower[text.lower()]


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="pretrain_gpt.py", description="Pretrain a GPT with TP x PP x ZeRO-DP.", allow_abbrev=False)
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
    g.add_argument("--layernorm-epsilon", "--norm-epsilon", dest="layernorm_epsilon", type=float, default=1e-5)
    g.add_argument("--init-method-std", type=float, default=0.02)

    g = p.add_argument_group("architecture (GPT-2 by default; these give the Llama / Mistral family)")
    g.add_argument("--normalization", type=_normalization, default="LayerNorm", metavar="{LayerNorm,RMSNorm}")
    g.add_argument("--apply-layernorm-1p", action="store_true",
                   help="zero-centred norm weights: each norm's weight w starts at 0 and the norm applies 1 + w "
                        "(Megatron-Core's zero_centered_gamma; LayerNorm and RMSNorm)")
    g.add_argument("--position-embedding-type", choices=list(POSITION_EMBEDDING_TYPES), default="learned_absolute")
    g.add_argument("--use-rotary-position-embeddings", dest="position_embedding_type", action="store_const",
                   const="rope", help="Megatron-DeepSpeed's spelling of --position-embedding-type rope")
    g.add_argument("--rotary-base", type=int, default=10000)
    g.add_argument("--rotary-percent", type=float, default=1.0)
    g.add_argument("--swiglu", action="store_true")
    g.add_argument("--group-query-attention", action="store_true",
                   help="grouped-query attention with --num-query-groups (default 1) key/value heads")
    g.add_argument("--num-query-groups", "--num-key-value-heads", dest="num_query_groups", type=int, default=None)
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    g.add_argument("--disable-bias-linear", dest="add_bias_linear", action="store_false")
    g.add_argument("--add-qkv-bias", action="store_true",
                   help="a bias on the QKV projection also with --disable-bias-linear (Qwen2)")

    g = p.add_argument_group("mixture of experts (Megatron-Core's flags; docs/moe.md)")
    g.add_argument("--num-experts", type=int, default=None, help="experts per MoE layer (none: a dense model)")
    g.add_argument("--moe-layer-freq", type=int, default=1, help="every N-th layer (0, N, 2N, ...) is an MoE layer")
    g.add_argument("--moe-ffn-hidden-size", type=int, default=None, help="an expert's width (default --ffn-hidden-size)")
    g.add_argument("--moe-router-topk", type=int, default=2)
    g.add_argument("--moe-router-pre-softmax", action="store_true",
                   help="softmax over all experts before the top-k (default: top-k of the logits, then softmax)")
    g.add_argument("--moe-router-load-balancing-type", choices=["aux_loss", "none", "seq_aux_loss", "sinkhorn"],
                   default="aux_loss")
    g.add_argument("--moe-aux-loss-coeff", type=float, default=0.0, help="the switch load-balancing loss's weight")
    g.add_argument("--moe-z-loss-coeff", type=float, default=None)
    g.add_argument("--moe-grouped-gemm", action="store_true",
                   help="run the local experts' matmuls as one grouped GEMM each (torch's grouped_mm on CUDA bf16; "
                        "the same parameters and checkpoints)")
    g.add_argument("--moe-token-dispatcher-type", choices=["alltoall", "allgather"], default="alltoall",
                   help="alltoall: variable-size all-to-all over the expert-parallel group; allgather: the tokens "
                        "all-gathered over it, the outputs reduce-scattered back (the same result)")
    g.add_argument("--moe-shared-expert-intermediate-size", type=int, default=None,
                   help="a shared expert MLP of this width that every token goes through, added to the routed "
                        "experts' output (tensor-parallel like the dense MLP, not expert-parallel)")
    g.add_argument("--moe-shared-expert-gate", action="store_true",
                   help="scale the shared expert's output by sigmoid(x g^T), g a [1, h] weight (Qwen2-MoE)")
    g.add_argument("--moe-shared-expert-overlap", action="store_true",
                   help="refused: the shared expert runs after the routed experts, not overlapped with dispatch")
    g.add_argument("--expert-model-parallel-size", type=int, default=1,
                   help="ranks the experts are spread over, carved out of the data-parallel ranks")
    g.add_argument("--expert-tensor-parallel-size", type=int, default=None,
                   help="ranks each expert is tensor-parallel over (default --tensor-model-parallel-size); other "
                        "than TP the expert groups are carved out of TP x DP, as Megatron-Core does (docs/moe.md)")

    add_core_router_flags(g)
    add_deepspeed_moe_flags(p)

    g = p.add_argument_group("memory and speed")
    g.add_argument("--recompute-granularity", choices=["full", "selective"], default=None,
                   help="recompute activations in backward: whole layers (full) or the attention core (selective)")
    g.add_argument("--recompute-method", choices=["uniform", "block"], default=None,
                   help="full recompute: chunks of --recompute-num-layers layers (uniform), or only the first "
                        "--recompute-num-layers layers of each pipeline stage (block)")
    g.add_argument("--recompute-num-layers", "--checkpoint-num-layers", dest="recompute_num_layers", type=int,
                   default=1)
    g.add_argument("--checkpoint-activations", action="store_true",
                   help="Megatron-DeepSpeed's name for --recompute-granularity full --recompute-method uniform")
    g.add_argument("--attention-backend", choices=["auto", "flash", "fused", "unfused", "local"], default="auto",
                   help="auto: torch's scaled_dot_product_attention where it applies, else unfused; flash: only "
                        "its kernels that never build the s x s matrix; fused: the fused causal-softmax kernel; "
                        "unfused (Megatron's local): matmul, causal softmax, matmul")
    g.add_argument("--sequence-parallel", action="store_true",
                   help="split LayerNorm and dropout regions along the sequence over the tensor-parallel group "
                        "(the identity at TP 1, as in Megatron)")

    g = p.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--context-parallel-size", type=int, default=1,
                   help="split each sequence over this many ranks (docs/context_parallel.md)")
    g.add_argument("--cp-comm-type", type=str, default="p2p",
                   help="how context-parallel ranks exchange K/V: p2p (ring), all_gather, a2a (Ulysses) or a2a+p2p "
                        "(a2a within groups of consecutive CP ranks, a ring across them)")
    g.add_argument("--hierarchical-context-parallel-sizes", type=int, nargs="+", default=None,
                   help="--cp-comm-type a2a+p2p: the all-to-all group's size and the ring's, their product CP")
    g.add_argument("--pipeline-partition-method", choices=["uniform", "parameters"], default="uniform")
    g.add_argument("--pipeline-partition", type=str, default=None,
                   help="explicit transformer layers per pipeline stage, e.g. 3,5")
    g.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None,
                   help="interleaved 1F1B: each pipeline rank holds --num-layers / (PP x N) model chunks of N "
                        "layers (virtual stages); the micro-batches per step must be a multiple of PP")
    g.add_argument("--micro-batch-size", type=int, default=None)
    g.add_argument("--global-batch-size", type=int, default=None)
    g.add_argument("--rampup-batch-size", type=int, nargs=3, default=None,
                   metavar=("START", "INCREMENT", "SAMPLES"),
                   help="Megatron-LM's batch ramp-up (a --train-samples run): the global batch starts at START and "
                        "grows by INCREMENT in equal sample intervals to --global-batch-size over SAMPLES samples")
    g.add_argument("--step-batch-size-schedule", type=str, nargs="+", default=None, metavar="THRESHOLD:BATCH",
                   help="Megatron-LM's step-wise global batch: \"THRESHOLD:BATCH ...\", each batch size from its "
                        "threshold in tokens on (K/M/B/T suffixes; the first at 0; megatron_zero/batch_schedule.py); "
                        "one quoted word or several (as an unquoted array expansion in a script hands them over)")
    g.add_argument("--zero-stage", type=int, default=1, choices=[0, 1, 2, 3])
    g.add_argument("--cpu-optimizer", "--zero-cpu-offload", dest="offload", action="store_const", const="cpu",
                   default="none", help="keep fp32 masters and Adam state in host memory (ZeRO-Offload)")
    g.add_argument("--zero-param-persistence-threshold", type=int, default=100_000,
                   help="ZeRO-3: parameters of at most this many elements stay gathered (DeepSpeed's "
                        "stage3_param_persistence_threshold; 0 gathers every parameter per layer)")
    g.add_argument("--zero-nvme-offload-path", type=str, default=None,
                   help="keep optimizer state in files under this path (ZeRO-Infinity style)")
    g.add_argument("--use-distributed-optimizer", action="store_true",
                   help="Megatron's distributed optimizer: ZeRO-1 (the default --zero-stage)")
    g.add_argument("--overlap-grad-reduce", action="store_true",
                   help="ZeRO 0-2: reduce gradient buckets asynchronously during backward")
    g.add_argument("--overlap-param-gather", action="store_true", default=None,
                   help="ZeRO 1/2: all-gather updated weights asynchronously, waited on at first use; "
                        "ZeRO-3: prefetch the next layer (on by default there, as in DeepSpeed)")
    g.add_argument("--zero-quantized-weights", action="store_true",
                   help="ZeRO++ qwZ (ZeRO-3): all-gather weights as int8 blocks (DeepSpeed's zero_quantized_weights)")
    g.add_argument("--zero-quantized-gradients", action="store_true",
                   help="ZeRO++ qgZ (ZeRO-3): reduce-scatter gradients as int8 blocks (zero_quantized_gradients)")
    g.add_argument("--zero-hpz-partition-size", type=int, default=1,
                   help="ZeRO++ hpZ (ZeRO-3): backward re-gathers weights within blocks of this many DP ranks "
                        "(zero_hpz_partition_size; 1: off)")
    g.add_argument("--deepspeed-config", "--deepspeed_config", dest="deepspeed_config", type=str, default=None)
    p.set_defaults(deepspeed_scheduler=None)  # the JSON's `scheduler`, set by deepspeed_config.py
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
    g.add_argument("--distributed-timeout-minutes", type=float, default=10.0)
    g.add_argument("--grad-reduce-in-bf16", action="store_true",
                   help="ZeRO 0-2 and the tied-embedding sum: reduce gradients in bfloat16 (half the bytes); "
                        "micro-batches are still accumulated in fp32")
    g.add_argument("--cpu-optimizer-threads", type=int, default=None,
                   help="threads of the offloaded optimizer step (--cpu-optimizer, --zero-nvme-offload-path); "
                        "default: this rank's share of the node's cores (its CPU affinity / ranks per node)")

    g = p.add_argument_group("training")
    g.add_argument("--train-iters", type=int, default=None)
    g.add_argument("--train-samples", type=int, default=None)
    g.add_argument("--lr", type=float, default=None)
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument("--decoupled-lr", type=float, default=None,
                   help="the word embedding's and output layer's own peak learning rate (Megatron's); they follow "
                        "the same warm-up and decay")
    g.add_argument("--decoupled-min-lr", type=float, default=None,
                   help="their floor, with --decoupled-lr (default --min-lr)")
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
    g.add_argument("--loss-scale", type=float, default=None, help="static loss scale of --fp16 (default: dynamic) or --bf16 (default: none), "
                   "as Megatron-LM")
    g.add_argument("--initial-loss-scale", type=float, default=2.0 ** 16)
    g.add_argument("--loss-scale-window", type=int, default=1000)
    g.add_argument("--min-loss-scale", type=float, default=1.0)
    g.add_argument("--hysteresis", type=int, default=2)
    g.add_argument("--max-consecutive-skipped-iterations", type=int, default=50, metavar="N",
                   help="stop the run (exit 2, nothing saved) after N optimizer steps in a row skipped for "
                        "overflowing gradients; 0: never (megatron_zero/stop_rules.py says why 50)")
    g.add_argument("--check-for-nan-in-loss-and-grad", dest="check_for_nan_in_loss_and_grad", action="store_true",
                   default=True, help="stop the run (exit 2, nothing saved) on an inf/NaN loss, or inf/NaN "
                                      "gradients where the loss scale is not dynamic (the default)")
    g.add_argument("--no-check-for-nan-in-loss-and-grad", dest="check_for_nan_in_loss_and_grad",
                   action="store_false")
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--exit-interval", type=int, default=None)
    g.add_argument("--exit-duration-in-mins", type=float, default=None)
    g.add_argument("--exit-signal-handler", action="store_true")

    g = p.add_argument_group("fusions")
    g.add_argument("--no-masked-softmax-fusion", dest="masked_softmax_fusion", action="store_false")
    g.add_argument("--no-bias-gelu-fusion", dest="bias_gelu_fusion", action="store_false")
    g.add_argument("--no-persist-layer-norm", dest="persist_layer_norm", action="store_false")
    g.add_argument("--no-rope-fusion", dest="rope_fusion", action="store_false")
    g.add_argument("--no-gradient-accumulation-fusion", dest="gradient_accumulation_fusion",
                   action="store_false")
    g.add_argument("--require-fused-kernels", action="store_true",
                   help="refuse to start unless every compiled kernel the chosen device uses is built and loads "
                        "(CUDA: megatron_zero._C_cuda; CPU: the C++ CPU kernels; with offload also the CPU Adam)")

    g = p.add_argument_group("data")
    g.add_argument("--data-path", nargs="*", default=None)
    g.add_argument("--split", type=str, default="969,30,1")
    g.add_argument("--data-cache-path", type=str, default=None)
    g.add_argument("--tokenizer-type", type=str, default=None,
                   help="default: GPT2BPETokenizer with --vocab-file and --merge-file (as Megatron-LM), else "
                        "SentencePieceTokenizer")
    g.add_argument("--tokenizer-model", type=str, default=None)
    g.add_argument("--vocab-file", type=str, default=None)
    g.add_argument("--merge-file", type=str, default=None)
    g.add_argument("--vocab-size", type=int, default=None,
                   help="NullTokenizer's vocabulary; TikTokenizer's (default 131072, special tokens included)")
    g.add_argument("--tiktoken-pattern", choices=["v1", "v2"], default=None,
                   help="TikTokenizer's split pattern (default v2, as Megatron-LM); other tokenizers have none, "
                        "and ignore it as Megatron-LM does")
    g.add_argument("--tiktoken-num-special-tokens", type=int, default=1000,
                   help="TikTokenizer: ids below this are special tokens; the vocabulary file's ranks follow")
    g.add_argument("--tokenizer-special-tokens", nargs="+", default=None,
                   help="TikTokenizer's named special tokens (ids 0, 1, ...; must include <unk> <s> </s> <mask> "
                        "<pad> <cls> <sep>), then <SPECIAL_k> fillers")

    g = p.add_argument_group("checkpointing and logging")
    g.add_argument("--save", type=str, default=None)
    g.add_argument("--load", type=str, default=None)
    g.add_argument("--save-interval", type=int, default=None)
    g.add_argument("--keep-last-k", type=int, default=None)
    g.add_argument("--async-save", action="store_true")
    g.add_argument("--save-megatron-deepspeed-layout", action="store_true",
                   help="write checkpoints Megatron-DeepSpeed's own --load resumes at this layout: at PP 1 its "
                        "--no-pipeline-parallel layout (weights nested in mp_rank_*'s module), at PP > 1 its pipeline "
                        "engine's; its scheduler, RNG and loss-scaler state (docs/checkpoint_interop.md)")
    g.add_argument("--save-16bit-model", action="store_true",
                   help="each save also writes <tag>/model_16bit/*.safetensors: the consolidated model in the "
                        "training dtype, bf16 when training in fp32 (DeepSpeed's "
                        "zero_optimization.stage3_gather_16bit_weights_on_model_save)")
    g.add_argument("--universal-checkpoint", action="store_true")
    g.add_argument("--ckpt-format", choices=("torch_dist", "torch"), default=None,
                   help="the format of the Megatron-LM checkpoint --load names (torch_dist: Megatron-Core's "
                        "distributed checkpoint; torch: legacy mp_rank_* files); without it the format is detected. "
                        "Saves are in this trainer's layout: tools/convert_checkpoint.py --to torch_dist converts them")
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
    g.add_argument("--log-params-norm", action="store_true", help="log the L2 norm of the weights (a collective)")
    g.add_argument("--log-memory-to-tensorboard", action="store_true")
    g.add_argument("--log-world-size-to-tensorboard", action="store_true")
    g.add_argument("--log-timers-to-tensorboard", action="store_true")
    g.add_argument("--timing-log-level", type=int, default=0, choices=[0, 1, 2],
                   help="0: no timers; 1: forward-backward and optimizer; 2: also forward, backward, communication")
    g.add_argument("--timing-log-option", choices=["max", "minmax", "all"], default="minmax")
    g.add_argument("--peak-tflops", type=float, default=None,
                   help="peak TFLOP/s of one device for the training dtype, for MFU (known for H100/H200/A100/V100)")
    g.add_argument("--wandb-project", type=str, default=None)
    g.add_argument("--wandb-exp-name", type=str, default=None)
    g.add_argument("--wandb-save-dir", type=str, default=None, help="default: <--save>/wandb")
    add_compat_flags(p)
    add_fp8_flags(p)
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
    _ulysses_as_context_parallel(args)
    cp = args.context_parallel_size
    _require(cp >= 1, f"--context-parallel-size must be at least 1, got {cp}")
    _require(world_size % (tp * pp * cp) == 0,
             f"world size {world_size} is not divisible by --tensor-model-parallel-size {tp} x "
             f"--pipeline-model-parallel-size {pp} x --context-parallel-size {cp}")
    args.world_size = world_size
    args.data_parallel_size = dp = world_size // (tp * pp * cp)
    if args.deepspeed_config:
        try:
            apply_deepspeed_config(args, args.deepspeed_config, explicit_flags(args))
        except DeepSpeedConfigError as err:
            raise ArgumentError(str(err)) from None
    _require(args.micro_batch_size is not None, "--micro-batch-size is required")
    _require(args.micro_batch_size >= 1, f"--micro-batch-size {args.micro_batch_size} must be positive")
    if args.global_batch_size is None and args.step_batch_size_schedule is None:
        args.global_batch_size = args.micro_batch_size * dp
    args.batch_schedule = _batch_schedule(args, dp)  # sets --global-batch-size from a step schedule
    mb, gbs = args.micro_batch_size, args.global_batch_size
    _require(mb >= 1 and gbs >= 1, f"--micro-batch-size {mb} and --global-batch-size {gbs} must be positive")
    _require(gbs % (mb * dp) == 0,
             f"--global-batch-size {gbs} is not divisible by --micro-batch-size {mb} x data-parallel size {dp} "
             f"(world {world_size} / (TP {tp} x PP {pp}))")
    args.num_micro_batches = gbs // (mb * dp)
    _require(args.max_consecutive_skipped_iterations >= 0, "--max-consecutive-skipped-iterations must be 0 "
             f"(never stop) or positive, got {args.max_consecutive_skipped_iterations}")
    _require(args.num_attention_heads % tp == 0,
             f"--num-attention-heads {args.num_attention_heads} is not divisible by "
             f"--tensor-model-parallel-size {tp}")
    _require(args.hidden_size % args.num_attention_heads == 0,
             f"--hidden-size {args.hidden_size} is not divisible by --num-attention-heads {args.num_attention_heads}")
    if args.ffn_hidden_size is None:
        args.ffn_hidden_size = default_ffn_hidden_size(args.hidden_size, args.swiglu)
    _require(args.ffn_hidden_size >= 1 and args.ffn_hidden_size % tp == 0,
             f"--ffn-hidden-size {args.ffn_hidden_size} is not a positive multiple of "
             f"--tensor-model-parallel-size {tp}")
    _validate_architecture(args, tp)
    _validate_moe(args, tp, dp)
    check_fp8_flags(args, _require)
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
    _validate_virtual_pipeline(args, pp)
    _validate_memory_flags(args, tp)
    _validate_context_parallel(args, tp)
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    _require(args.seq_length <= args.max_position_embeddings,
             f"--seq-length {args.seq_length} is longer than --max-position-embeddings "
             f"{args.max_position_embeddings}")
    _require(not (args.fp16 and args.bf16), "--fp16 and --bf16 cannot both be given; choose one")
    _require(args.loss_scale is None or args.fp16 or args.bf16,
             f"--loss-scale {args.loss_scale} scales the loss of --fp16 or --bf16 training; fp32 trains unscaled")
    _require((args.train_iters is None) != (args.train_samples is None),
             "give exactly one of --train-iters and --train-samples")
    if args.train_samples is not None:
        args.train_iters = args.batch_schedule.train_iters(args.train_samples)
    _require(args.train_iters >= 0, f"--train-iters {args.train_iters} must not be negative")
    if args.batch_schedule.varies:
        try:
            check_reachable(args.batch_schedule, args.train_iters, pp, args.virtual_pipeline_model_parallel_size > 1)
        except BatchScheduleError as err:
            raise ArgumentError(str(err)) from None
    _require(args.lr is not None and args.lr > 0, "--lr is required and must be positive")
    _require(0 <= args.min_lr <= args.lr, f"--min-lr {args.min_lr} must lie between 0 and --lr {args.lr}")
    _require(args.lr_warmup_iters >= 0, f"--lr-warmup-iters {args.lr_warmup_iters} must not be negative")
    if args.lr_decay_iters is None:
        args.lr_decay_iters = args.train_iters
    if args.tokenizer_type is None:
        args.tokenizer_type = ("GPT2BPETokenizer" if args.vocab_file and args.merge_file
                               else "SentencePieceTokenizer")
    if args.attention_backend == "local":
        args.attention_backend = "unfused"
    try:
        validate_compat(args)
    except CompatError as err:
        raise ArgumentError(str(err)) from None
    for name in ("adam_beta1", "adam_beta2"):
        value = getattr(args, name)
        _require(0 <= value < 1, f"--{name.replace('_', '-')} {value} must lie in [0, 1)")
    _require(args.clip_grad >= 0, f"--clip-grad {args.clip_grad} must not be negative (0 disables clipping)")
    _require(args.save_interval is None or args.save_interval >= 1,
             f"--save-interval {args.save_interval} must be at least 1")
    _require(args.save_interval is None or args.save,
             "--save-interval is given without --save; say where checkpoints go")
    _require(args.keep_last_k is None or args.keep_last_k >= 1, f"--keep-last-k {args.keep_last_k} must be >= 1")
    _require(not args.save_megatron_deepspeed_layout or args.zero_stage < 3,
             "--save-megatron-deepspeed-layout writes ZeRO stage 0, 1 or 2 checkpoints, not --zero-stage 3")
    _require(not args.save_megatron_deepspeed_layout or args.zero_stage > 0 or args.data_parallel_size == 1,
             "--save-megatron-deepspeed-layout at --zero-stage 0 needs DP=1 (Megatron-DeepSpeed without ZeRO keeps "
             "one optimizer state per model-parallel rank); use --zero-stage 1")
    _require(not args.save_megatron_deepspeed_layout or not args.batch_schedule.varies,
             "--save-megatron-deepspeed-layout writes the learning-rate schedule from a constant global batch; "
             "with --rampup-batch-size or --step-batch-size-schedule save in the default layout")
    _require(not args.save_megatron_deepspeed_layout or args.deepspeed_scheduler is None,
             "--save-megatron-deepspeed-layout writes Megatron's learning-rate schedule; the DeepSpeed JSON's "
             "`scheduler` has no counterpart there: give --lr-warmup-iters/--lr-decay-iters instead")
    _require(not (args.save_megatron_deepspeed_layout and args.apply_layernorm_1p and args.normalization == "RMSNorm"),
             "--save-megatron-deepspeed-layout with --apply-layernorm-1p needs --normalization LayerNorm: "
             "Megatron-DeepSpeed's RMSNorm ignores the switch and would read the zero-centred weights as gamma")
    _require(not (args.save_megatron_deepspeed_layout and args.num_experts is not None),
             "--save-megatron-deepspeed-layout writes dense GPTs only; save an MoE model without it (DeepSpeed-MoE's "
             "file layout, which --load and tools/ds_to_universal.py read)")
    _require(args.log_interval >= 1 and args.eval_interval >= 1,
             "--log-interval and --eval-interval must be at least 1")
    _require(args.eval_iters >= 0, f"--eval-iters {args.eval_iters} must not be negative")
    _require(args.zero_stage < 3 or pp == 1,
             f"--zero-stage 3 partitions parameters across data-parallel ranks and cannot be combined with "
             f"--pipeline-model-parallel-size {pp}; use --zero-stage 1 or 2 with pipelining")
    _require(args.zero_param_persistence_threshold >= 0,
             f"--zero-param-persistence-threshold {args.zero_param_persistence_threshold} must not be negative")
    _check_overlap(args)
    if args.zero_nvme_offload_path:
        args.offload = "nvme"
    _require(args.offload == "none" or args.zero_stage >= 1,
             f"optimizer offload ({args.offload}) needs --zero-stage 1, 2 or 3, not {args.zero_stage}")
    _check_cpu_optimizer_threads(args)
    _check_logging(args)
    _validate_decoupled_lr(args)
    _require(not (args.device == "cpu" and args.distributed_backend == "nccl"),
             "--distributed-backend nccl needs GPUs but --device cpu was given; use --distributed-backend gloo")
    if args.load and not _same_dir(args.load, args.save):  # --load = --save: resume if anything is there
        _require(os.path.isdir(args.load), f"--load {args.load} is not a directory")
    if args.data_path:
        _check_data_path(args.data_path)
    args.params_dtype = "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32"
    return args


def _batch_schedule(args, dp: int):
    try:
        return schedule_from_args(args, dp)
    except BatchScheduleError as err:
        raise ArgumentError(str(err)) from None


def _same_dir(a: str, b: Optional[str]) -> bool:
    return b is not None and os.path.abspath(a) == os.path.abspath(b)


def _check_cpu_optimizer_threads(args):
    """--cpu-optimizer-threads: only with an offloaded optimizer, 1 to this machine's cores; default its share."""
    from .ops.cpu_adam import default_offload_threads
    n, cores = args.cpu_optimizer_threads, os.cpu_count() or 1
    if n is None:
        args.cpu_optimizer_threads = default_offload_threads() if args.offload != "none" else None
        return
    _require(args.offload != "none", f"--cpu-optimizer-threads {n} sets the threads of the offloaded optimizer "
             "step; add --cpu-optimizer (or --zero-nvme-offload-path) or drop it")
    _require(1 <= n <= cores, f"--cpu-optimizer-threads {n} must lie between 1 and this machine's {cores} cores")


def _validate_decoupled_lr(args):
    """--decoupled-lr / --decoupled-min-lr: values, and what cannot carry a second learning rate."""
    if args.decoupled_lr is None:
        _require(args.decoupled_min_lr is None, f"--decoupled-min-lr {args.decoupled_min_lr} is the floor of "
                 "--decoupled-lr, which is not given; give both, or neither")
        return
    _require(args.decoupled_lr > 0, f"--decoupled-lr {args.decoupled_lr} must be positive")
    floor = args.min_lr if args.decoupled_min_lr is None else args.decoupled_min_lr
    _require(0 <= floor <= args.decoupled_lr, f"--decoupled-min-lr {floor} must lie between 0 and --decoupled-lr "
             f"{args.decoupled_lr}{' (it defaults to --min-lr)' if args.decoupled_min_lr is None else ''}")
    _require(args.deepspeed_scheduler is None, "--decoupled-lr follows Megatron's schedule; the DeepSpeed JSON's "
             "`scheduler` has one learning rate: give --lr-warmup-iters/--lr-decay-iters instead")
    _require(not args.save_megatron_deepspeed_layout, "--save-megatron-deepspeed-layout cannot hold --decoupled-lr: "
             "Megatron-DeepSpeed's optimizer has no decoupled param group")


def _check_logging(args):
    _require(args.peak_tflops is None or args.peak_tflops > 0, f"--peak-tflops {args.peak_tflops} must be positive")
    if args.wandb_project is None:
        _require(args.wandb_exp_name is None and args.wandb_save_dir is None,
                 "--wandb-exp-name / --wandb-save-dir are given without --wandb-project; name the project")
        return
    _require(_importable("wandb"),
             f"--wandb-project {args.wandb_project} needs the wandb package, which is not installed (pip install wandb)")
    _require(bool(args.wandb_exp_name), "--wandb-project needs --wandb-exp-name (the run's name)")
    if args.wandb_save_dir is None:
        _require(args.save is not None, "--wandb-project needs --wandb-save-dir (or --save, to write under <save>/wandb)")
        args.wandb_save_dir = os.path.join(args.save, "wandb")


def _importable(module: str) -> bool:
    try:
        importlib.import_module(module)
        return True
    except ImportError:
        return False


def _validate_architecture(args, tp: int):
    """Grouped-query attention and RoPE settings that can work at this TP size."""
    heads = args.num_attention_heads
    if args.num_query_groups is None:
        args.num_query_groups = 1 if args.group_query_attention else heads
    groups = args.num_query_groups
    args.group_query_attention = groups != heads  # recorded as Megatron-LM reads it (model/architecture.py)
    _require(groups >= 1 and heads % groups == 0,
             f"--num-attention-heads {heads} is not divisible by --num-query-groups {groups}")
    _require((groups % tp if groups >= tp else tp % groups) == 0,
             f"--num-query-groups {groups} and --tensor-model-parallel-size {tp} must divide one another "
             "(fewer groups than TP ranks replicate each group's key/value heads)")
    head_dim = args.hidden_size // heads
    _require((heads + 2 * groups) * head_dim % tp == 0,
             f"the fused QKV size ({heads} + 2 x {groups} groups) x head dim {head_dim} is not divisible by "
             f"--tensor-model-parallel-size {tp}")
    _require(0 < args.rotary_percent <= 1, f"--rotary-percent {args.rotary_percent} must lie in (0, 1]")
    _require(args.rotary_base >= 1, f"--rotary-base {args.rotary_base} must be positive")
    if args.position_embedding_type == "rope":
        _require(int(head_dim * args.rotary_percent) % 2 == 0,
                 f"--rotary-percent {args.rotary_percent} of head dim {head_dim} rotates an odd number of "
                 "features; RoPE rotates pairs")


def _validate_moe(args, tp: int, dp: int):
    """The MoE flags this trainer implements, and the layouts it runs them at (docs/moe.md)."""
    try:
        apply_deepspeed_moe_flags(args, explicit_flags(args))
    except DeepSpeedMoEError as err:
        raise ArgumentError(str(err)) from None
    ep, experts = args.expert_model_parallel_size, args.num_experts
    _require(ep >= 1, f"--expert-model-parallel-size {ep} must be at least 1")
    _validate_shared_expert(args, tp)
    _validate_expert_tensor_parallel(args, tp, dp)
    if experts is None:
        _require(ep == 1, f"--expert-model-parallel-size {ep} needs MoE layers; give --num-experts")
        _require(args.moe_expert_capacity_factor is None, "--moe-expert-capacity-factor configures MoE layers; "
                 "give --num-experts")
        return
    _require(experts >= 1 and experts % ep == 0,
             f"--num-experts {experts} must be a positive multiple of --expert-model-parallel-size {ep}")
    cp = args.context_parallel_size
    _require(args.expert_tensor_parallel_size != tp or (dp * cp) % ep == 0,
             f"--expert-model-parallel-size {ep} must divide the data-parallel size {dp}"
             + (f" x --context-parallel-size {cp} (= {dp * cp})" if cp > 1 else "")
             + ": expert parallelism is carved out of the data-parallel" + (" and context-parallel" if cp > 1 else "")
             + " ranks")
    _require(1 <= args.moe_router_topk <= experts,
             f"--moe-router-topk {args.moe_router_topk} must lie in 1..--num-experts {experts}")
    _require(args.moe_layer_freq >= 1, f"--moe-layer-freq {args.moe_layer_freq} must be at least 1")
    if args.moe_ffn_hidden_size is None:
        args.moe_ffn_hidden_size = args.ffn_hidden_size
    etp = args.expert_tensor_parallel_size
    _require(args.moe_ffn_hidden_size >= 1 and args.moe_ffn_hidden_size % etp == 0,
             f"--moe-ffn-hidden-size {args.moe_ffn_hidden_size} is not a positive multiple of "
             f"--expert-tensor-parallel-size {etp}" + (" (default: --tensor-model-parallel-size)" if etp == tp else ""))
    check_core_router_flags(args, _require)
    _require(args.moe_aux_loss_coeff >= 0 and (args.moe_z_loss_coeff or 0) >= 0,
             "--moe-aux-loss-coeff and --moe-z-loss-coeff must not be negative")
    _validate_moe_sequence_parallel(args, tp)
    if ep > 1:
        _require(not (args.zero_quantized_weights or args.zero_quantized_gradients or args.zero_hpz_partition_size > 1),
                 f"--expert-model-parallel-size {ep} runs without ZeRO++ (--zero-quantized-weights, "
                 "--zero-quantized-gradients, --zero-hpz-partition-size); drop those flags")


def _validate_expert_tensor_parallel(args, tp: int, dp: int):
    """--expert-tensor-parallel-size (default TP): the expert groups carved out of TP x DP (topology.py)."""
    if args.expert_tensor_parallel_size is None:
        args.expert_tensor_parallel_size = tp
    etp, ep = args.expert_tensor_parallel_size, args.expert_model_parallel_size
    if etp == tp:
        return
    _require(etp >= 1, f"--expert-tensor-parallel-size {etp} must be at least 1")
    _require(args.num_experts is not None, f"--expert-tensor-parallel-size {etp} splits the experts of MoE layers; "
             "give --num-experts")
    _require((tp * dp) % (etp * ep) == 0,
             f"--expert-tensor-parallel-size {etp} x --expert-model-parallel-size {ep} must divide TP x DP = {tp * dp}: "
             "the experts' tensor-, expert- and expert-data-parallel groups are carved out of those ranks")
    _require(tp == 1 or args.sequence_parallel,
             f"--expert-tensor-parallel-size {etp} other than --tensor-model-parallel-size {tp} needs "
             "--sequence-parallel: each TP rank then routes its own tokens (Megatron-Core's rule)")
    _require(args.context_parallel_size == 1, f"--expert-tensor-parallel-size {etp} other than TP with "
             f"--context-parallel-size {args.context_parallel_size} is not available")
    _require(args.zero_stage in (0, 1, 2) and args.offload == "none" and not args.zero_nvme_offload_path,
             f"--expert-tensor-parallel-size {etp} other than TP runs with --zero-stage 0, 1 or 2 and without "
             "optimizer offload")
    _require(not args.universal_checkpoint,
             f"--expert-tensor-parallel-size {etp} other than --tensor-model-parallel-size {tp} with "
             "--universal-checkpoint is not available: a universal checkpoint's experts load split by TP")
    _require(args.moe_token_dispatcher_type == "alltoall", f"--moe-token-dispatcher-type allgather with "
             f"--expert-tensor-parallel-size {etp} other than TP is not available; use alltoall")


def _validate_moe_sequence_parallel(args, tp: int):
    """--sequence-parallel with MoE layers: each TP rank routes its own sequence chunk (moe/layer.py)."""
    if not (args.sequence_parallel and tp > 1):
        return
    _require(args.moe_router_load_balancing_type != "seq_aux_loss" and args.moe_expert_capacity_factor is None
             and args.moe_capacity_factor is None,
             "--sequence-parallel with MoE layers routes each TP rank's sequence chunk alone; "
             "--moe-router-load-balancing-type seq_aux_loss and expert capacity (--moe-expert-capacity-factor, "
             "DeepSpeed-MoE's capacity flags) are not available with it")
    _require(args.moe_token_dispatcher_type == "alltoall",
             "--moe-token-dispatcher-type allgather runs experts whole on every TP rank's same tokens; with "
             "--sequence-parallel use alltoall")


def _validate_shared_expert(args, tp: int):
    """--moe-shared-expert-intermediate-size and its gate (moe/shared_expert.py)."""
    shared = args.moe_shared_expert_intermediate_size
    _require(not args.moe_shared_expert_overlap, "--moe-shared-expert-overlap is not implemented: the shared expert "
             "runs after the routed experts; drop the flag (the result is the same)")
    _require(shared is None or args.num_experts is not None,
             f"--moe-shared-expert-intermediate-size {shared} belongs to MoE layers; give --num-experts")
    _require(not args.moe_shared_expert_gate or shared is not None,
             "--moe-shared-expert-gate gates the shared expert; give --moe-shared-expert-intermediate-size")
    _require(shared is None or (shared >= 1 and shared % tp == 0),
             f"--moe-shared-expert-intermediate-size {shared} is not a positive multiple of "
             f"--tensor-model-parallel-size {tp}")


def _check_overlap(args):
    """--use-distributed-optimizer, --overlap-*, and ZeRO++'s flags against the ZeRO stage."""
    stage = args.zero_stage
    _require(not args.use_distributed_optimizer or stage >= 1,
             f"--use-distributed-optimizer is ZeRO-1 and contradicts --zero-stage {stage}; drop one of them")
    _require(not args.overlap_grad_reduce or stage <= 2,
             "--overlap-grad-reduce applies to --zero-stage 0, 1 or 2 (ZeRO-3 reduce-scatters each layer's "
             "gradients during backward already); drop it or choose another stage")
    _require(not args.grad_reduce_in_bf16 or stage <= 2,
             "--grad-reduce-in-bf16 applies to --zero-stage 0, 1 or 2 (ZeRO-3 reduce-scatters in fp32); "
             "drop it or choose another stage")
    zeropp = [flag for flag, on in (("--zero-quantized-weights", args.zero_quantized_weights),
                                    ("--zero-quantized-gradients", args.zero_quantized_gradients),
                                    ("--zero-hpz-partition-size", args.zero_hpz_partition_size != 1)) if on]
    _require(not zeropp or stage == 3,
             f"{' and '.join(zeropp)} (ZeRO++) need --zero-stage 3, not {stage}")
    hpz, dp = args.zero_hpz_partition_size, args.data_parallel_size
    _require(hpz >= 1 and dp % hpz == 0,
             f"--zero-hpz-partition-size {hpz} (zero_hpz_partition_size) must divide the data-parallel size {dp}")
    if args.overlap_param_gather is None:
        args.overlap_param_gather = stage == 3
    _require(not args.overlap_param_gather or stage >= 1,
             "--overlap-param-gather needs --use-distributed-optimizer (ZeRO-1) or --zero-stage 2 or 3: "
             "with --zero-stage 0 there are no parameters to gather")


def _validate_virtual_pipeline(args, pp: int):
    """--num-layers-per-virtual-pipeline-stage N -> args.virtual_pipeline_model_parallel_size, Megatron's rules."""
    n, layers = args.num_layers_per_virtual_pipeline_stage, args.num_layers
    args.virtual_pipeline_model_parallel_size = 1
    if n is None:
        return
    _require(pp > 1, "--num-layers-per-virtual-pipeline-stage interleaves pipeline stages and needs "
                     f"--pipeline-model-parallel-size of at least 2, not {pp}")
    _require(n >= 1 and layers % (pp * n) == 0,
             f"--num-layers {layers} is not divisible by --pipeline-model-parallel-size {pp} x "
             f"--num-layers-per-virtual-pipeline-stage {n}; each pipeline rank holds chunks of N layers")
    _require(args.pipeline_partition is None and args.pipeline_partition_method == "uniform",
             "--pipeline-partition and --pipeline-partition-method parameters cannot be combined with "
             "--num-layers-per-virtual-pipeline-stage, whose virtual stages hold N layers each")
    args.virtual_pipeline_model_parallel_size = v = layers // (pp * n)
    m = args.num_micro_batches
    _require(v == 1 or m % pp == 0,
             f"{m} micro-batches per step (--global-batch-size {args.global_batch_size} / (--micro-batch-size "
             f"{args.micro_batch_size} x DP {args.data_parallel_size})) is not divisible by "
             f"--pipeline-model-parallel-size {pp}, which the interleaved schedule of "
             "--num-layers-per-virtual-pipeline-stage needs")


def _validate_memory_flags(args, tp: int):
    if args.checkpoint_activations:
        _require(args.recompute_granularity in (None, "full"),
                 f"--checkpoint-activations means --recompute-granularity full; it contradicts "
                 f"--recompute-granularity {args.recompute_granularity}")
        args.recompute_granularity = "full"
        args.recompute_method = args.recompute_method or "uniform"
    if args.recompute_granularity == "full":
        _require(args.recompute_method is not None,
                 "--recompute-granularity full needs --recompute-method uniform or block")
    else:
        _require(args.recompute_method is None,
                 f"--recompute-method {args.recompute_method} applies only to --recompute-granularity full")
    _require(1 <= args.recompute_num_layers <= args.num_layers,
             f"--recompute-num-layers {args.recompute_num_layers} must lie between 1 and --num-layers "
             f"{args.num_layers}")
    _require(args.attention_backend != "flash" or args.attention_dropout == 0 or torch.cuda.is_available(),
             f"--attention-backend flash with --attention-dropout {args.attention_dropout} needs CUDA: torch has "
             "no flash kernel with dropout on this machine; use --attention-backend auto or --attention-dropout 0")
    _require(not args.sequence_parallel or args.seq_length % tp == 0,
             f"--sequence-parallel splits --seq-length {args.seq_length} over --tensor-model-parallel-size {tp}, "
             "which does not divide it")


CP_COMM_TYPES = ("p2p", "all_gather", "a2a", "a2a+p2p")


def _ulysses_as_context_parallel(args):
    """Megatron-DeepSpeed's --ds-sequence-parallel-size N (DeepSpeed-Ulysses) is context parallelism over N
    ranks with the all-to-all that scatters heads: --context-parallel-size N --cp-comm-type a2a."""
    ds = args.ds_sequence_parallel_size
    if ds == 1:
        return
    _require(ds > 1, f"--ds-sequence-parallel-size must be at least 1, got {ds}")
    given = explicit_flags(args)
    _require(args.context_parallel_size in (1, ds),
             f"--ds-sequence-parallel-size {ds} and --context-parallel-size {args.context_parallel_size} name two "
             "sequence splits; give one of them")
    _require("cp_comm_type" not in given or args.cp_comm_type == "a2a",
             f"--ds-sequence-parallel-size {ds} is DeepSpeed-Ulysses, the a2a exchange; it contradicts "
             f"--cp-comm-type {args.cp_comm_type}")
    args.context_parallel_size, args.cp_comm_type = ds, "a2a"


def cp_a2a_size(args) -> int:
    """The all-to-all group's size of --cp-comm-type a2a+p2p (build_parallel_state's cp_a2a); 0 otherwise."""
    return args.hierarchical_context_parallel_sizes[0] if args.cp_comm_type == "a2a+p2p" else 0


def _validate_hierarchical_cp(args, tp: int):
    """--hierarchical-context-parallel-sizes A P with --cp-comm-type a2a+p2p (Megatron-Core's meaning)."""
    cp, kind, sizes = args.context_parallel_size, args.cp_comm_type, args.hierarchical_context_parallel_sizes
    if kind != "a2a+p2p":
        _require(sizes is None, f"--hierarchical-context-parallel-sizes applies to --cp-comm-type a2a+p2p, not {kind}")
        return
    _require(sizes is not None and len(sizes) == 2 and min(sizes) >= 1 and sizes[0] * sizes[1] == cp,
             f"--cp-comm-type a2a+p2p needs --hierarchical-context-parallel-sizes A P: the all-to-all group's size "
             f"and the ring's, with A x P = --context-parallel-size {cp} (given: {sizes})")
    heads = args.num_attention_heads // tp
    _require(heads % sizes[0] == 0,
             f"--cp-comm-type a2a+p2p scatters each tensor-parallel rank's {heads} attention heads "
             f"(--num-attention-heads {args.num_attention_heads} / --tensor-model-parallel-size {tp}) over the "
             f"all-to-all size {sizes[0]} of --hierarchical-context-parallel-sizes, which does not divide them")


def _validate_context_parallel(args, tp: int):
    """--context-parallel-size and --cp-comm-type: the layouts and the compositions context parallelism has."""
    cp, kind = args.context_parallel_size, args.cp_comm_type
    _require(kind in CP_COMM_TYPES, f"--cp-comm-type {kind} is not available; use p2p (ring exchange of K/V), "
             "all_gather, a2a (Ulysses' head scatter) or a2a+p2p (a2a within groups, a ring across them)")
    _validate_hierarchical_cp(args, tp)
    if cp == 1:
        return
    seq = args.seq_length
    _require(seq % (2 * cp) == 0,
             f"--seq-length {seq} is not a multiple of 2 x --context-parallel-size {cp}: each rank holds two of "
             f"{2 * cp} equal chunks of the sequence")
    _require(not args.sequence_parallel or (seq // cp) % tp == 0,
             f"--sequence-parallel splits each context-parallel rank's {seq // cp} tokens (--seq-length {seq} / "
             f"--context-parallel-size {cp}) over --tensor-model-parallel-size {tp}, which does not divide them")
    heads = args.num_attention_heads // tp
    _require(kind != "a2a" or heads % cp == 0,
             f"--cp-comm-type a2a scatters each tensor-parallel rank's {heads} attention heads (--num-attention-heads "
             f"{args.num_attention_heads} / --tensor-model-parallel-size {tp}) over --context-parallel-size {cp}, "
             "which does not divide them; use p2p or all_gather")
    refused = [(args.zero_hpz_partition_size > 1, "--zero-hpz-partition-size")]
    if kind != "a2a":  # p2p and all_gather compute attention blocks themselves; a2a runs --attention-backend's
        refused += [(args.attention_backend != "auto", f"--attention-backend {args.attention_backend} (it applies "
                                                       "to --cp-comm-type a2a)")]
    for refuse, flag in refused:
        _require(not refuse, f"--context-parallel-size {cp} with --cp-comm-type {kind} cannot be combined with {flag}")


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


def parse_args(argv: Optional[List[str]] = None, world_size: int = 1, report: bool = True):
    """Parse and validate; on bad input print one sentence to stderr (if `report`: one rank of many) and exit 2."""
    try:
        return validate_args(parse_command_line(argv), world_size)
    except ArgumentError as err:
        if report:
            for line in str(err).splitlines():
                print(f"pretrain_gpt.py: error: {line}", file=sys.stderr)
        raise SystemExit(2) from None


def parse_command_line(argv: Optional[List[str]] = None):
    """argv -> args namespace; every refused or unknown flag in one ArgumentError, one sentence (line) each."""
    argv = sys.argv[1:] if argv is None else list(argv)
    sentences, kept = refusals(argv)
    parser = build_parser()
    known = parser._option_string_actions  # argparse's table of option strings (stable since Python 2.7)
    sentences += [unknown_flag_sentence(t.split("=", 1)[0]) for t in kept
                  if t.startswith("--") and t.split("=", 1)[0] not in known]
    try:
        args, leftover = parser.parse_known_args(kept)
    except ArgumentError as err:
        raise ArgumentError("\n".join(sentences + [str(err)])) from None
    for k, token in enumerate(leftover):
        if token.startswith("-") and not token.startswith("--"):
            sentences.append(unknown_flag_sentence(token))
        elif not token.startswith("-") and (k == 0 or not leftover[k - 1].startswith("-")):
            sentences.append(f"{token!r} is not the value of any flag (see --help).")
    if sentences:
        raise ArgumentError("\n".join(sentences))
    return args


def args_to_dict(args) -> dict:
    """The arguments as a plain dict (JSON-able values), for checkpoints."""
    return {k: v for k, v in vars(args).items() if isinstance(v, (int, float, str, bool, list, type(None)))}
