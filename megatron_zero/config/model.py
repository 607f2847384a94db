"""The model's flags (sizes, architecture, recompute and attention kernels): their declarations, the
defaults derived from other flags, and the checks at a tensor-parallel size. GPTConfig is built from the
checked flags by model/architecture.py's gpt_config, the one args -> model settings mapping."""
from __future__ import annotations

import argparse

from ..model.config import NORMALIZATIONS, POSITION_EMBEDDING_TYPES, default_ffn_hidden_size
from .errors import require


def _normalization(text: str) -> str:
    """LayerNorm or RMSNorm, in any case (Megatron-DeepSpeed writes layernorm / rmsnorm)."""
    by_lower = {n.lower(): n for n in NORMALIZATIONS}
    if text.lower() not in by_lower:
        raise argparse.ArgumentTypeError(f"{text!r} is not one of {', '.join(NORMALIZATIONS)}")
    return by_lower[text.lower()]


def add_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model sizes")
    g.add_argument("--num-layers", type=int, required=True,
                   help="transformer layers of the model")
    g.add_argument("--hidden-size", type=int, required=True,
                   help="the transformer's hidden width h")
    g.add_argument("--num-attention-heads", type=int, required=True,
                   help="attention heads per layer (query heads with grouped-query attention)")
    g.add_argument("--ffn-hidden-size", type=int, default=None,
                   help="the MLP's inner width (default 4 x --hidden-size; with --swiglu 2/3 of that, rounded down to a multiple of 64)")
    g.add_argument("--seq-length", type=int, required=True,
                   help="tokens per training sample")
    g.add_argument("--max-position-embeddings", type=int, default=None,
                   help="positions the learned position table holds (default --seq-length)")
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128,
                   help="pad the vocabulary to a multiple of this x --tensor-model-parallel-size")
    g.add_argument("--hidden-dropout", type=float, default=0.1,
                   help="dropout probability after the attention and MLP outputs")
    g.add_argument("--attention-dropout", type=float, default=0.1,
                   help="dropout probability on the attention weights")
    g.add_argument("--layernorm-epsilon", "--norm-epsilon", dest="layernorm_epsilon", type=float, default=1e-5,
                   help="epsilon of LayerNorm / RMSNorm")
    g.add_argument("--init-method-std", type=float, default=0.02,
                   help="standard deviation of the normal weight initialisation (output projections scaled by 1/sqrt(2 x layers))")
    g = p.add_argument_group("architecture (GPT-2 by default; these give the Llama / Mistral family)")
    g.add_argument("--normalization", type=_normalization, default="LayerNorm", metavar="{LayerNorm,RMSNorm}",
                   help="the norm of each layer and the final norm: LayerNorm (GPT-2) or RMSNorm (Llama), any case")
    g.add_argument("--apply-layernorm-1p", action="store_true",
                   help="zero-centred norm weights: each norm's weight w starts at 0 and the norm applies 1 + w "
                        "(Megatron-Core's zero_centered_gamma; LayerNorm and RMSNorm)")
    g.add_argument("--position-embedding-type", choices=list(POSITION_EMBEDDING_TYPES), default="learned_absolute",
                   help="learned_absolute: a learned table (GPT-2); rope: rotary embeddings (Llama)")
    g.add_argument("--use-rotary-position-embeddings", dest="position_embedding_type", action="store_const",
                   const="rope", help="Megatron-DeepSpeed's spelling of --position-embedding-type rope")
    g.add_argument("--kv-channels", type=int, default=None,
                   help="each attention head's dimension (default --hidden-size / --num-attention-heads; Qwen3: 128)")
    g.add_argument("--qk-layernorm", action="store_true",
                   help="QK-norm: the layer's norm (--normalization) over each head's query and key, before RoPE "
                        "(Qwen3, OLMo 2); one weight per head dimension, shared by the heads")
    g.add_argument("--rotary-base", type=int, default=10000,
                   help="RoPE's base period theta")
    g.add_argument("--rotary-percent", type=float, default=1.0,
                   help="the fraction of each head's dimensions RoPE rotates")
    g.add_argument("--swiglu", action="store_true",
                   help="the MLP's activation is SwiGLU (two input projections, Llama) instead of GeLU")
    g.add_argument("--group-query-attention", action="store_true",
                   help="grouped-query attention with --num-query-groups (default 1) key/value heads")
    g.add_argument("--num-query-groups", "--num-key-value-heads", dest="num_query_groups", type=int, default=None,
                   help="key/value heads of grouped-query attention (default: --num-attention-heads, or 1 with --group-query-attention)")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true",
                   help="an output layer of its own instead of the word embedding's transpose")
    g.add_argument("--disable-bias-linear", dest="add_bias_linear", action="store_false",
                   help="no biases on the linear layers (Llama)")
    g.add_argument("--add-qkv-bias", action="store_true",
                   help="a bias on the QKV projection also with --disable-bias-linear (Qwen2)")
    g = p.add_argument_group("recompute and attention kernels")
    g.add_argument("--recompute-granularity", choices=["full", "selective"], default=None,
                   help="recompute activations in backward: whole layers (full) or the attention core (selective)")
    g.add_argument("--recompute-method", choices=["uniform", "block"], default=None,
                   help="full recompute: chunks of --recompute-num-layers layers (uniform), or only the first "
                        "--recompute-num-layers layers of each pipeline stage (block)")
    g.add_argument("--recompute-num-layers", "--checkpoint-num-layers", dest="recompute_num_layers", type=int,
                   default=1,
                   help="full recompute: layers per recomputed chunk (uniform) or recomputed layers per stage (block)")
    g.add_argument("--checkpoint-activations", action="store_true",
                   help="Megatron-DeepSpeed's name for --recompute-granularity full --recompute-method uniform")
    g.add_argument("--attention-backend", choices=["auto", "flash", "fused", "unfused", "local"], default="auto",
                   help="auto: torch's scaled_dot_product_attention where it applies, else unfused; flash: only "
                        "its kernels that never build the s x s matrix; fused: the fused causal-softmax kernel; "
                        "unfused (Megatron's local): matmul, causal softmax, matmul")
    g.add_argument("--use-flash-attn", action="store_true",
                   help="Megatron-LM's older switch for FlashAttention: --attention-backend flash")
    g.add_argument("--transformer-impl", choices=["local", "transformer_engine"], default=None,
                   help="Megatron-LM's choice of layer implementation; either way this build's own layers run "
                        "(Megatron-Core's parameter layout, the csrc/ fused kernels; Transformer Engine is not used), "
                        "and the run says so in one line")


def check_sizes(args) -> None:
    """The model's sizes are positive (the parallel sizes: parallel.py)."""
    for flag in ("num_layers", "hidden_size", "num_attention_heads", "seq_length"):
        value = getattr(args, flag)
        require(value >= 1, f"--{flag.replace('_', '-')} must be at least 1, got {value}")


def check(args, tp: int) -> None:
    """Heads, widths and positions that work at tensor-parallel size `tp`; fills --ffn-hidden-size and
    --max-position-embeddings' defaults, --num-query-groups and the recompute switches."""
    require(args.num_attention_heads % tp == 0,
            f"--num-attention-heads {args.num_attention_heads} is not divisible by --tensor-model-parallel-size {tp}")
    require(args.kv_channels is not None or args.hidden_size % args.num_attention_heads == 0,
            f"--hidden-size {args.hidden_size} is not divisible by --num-attention-heads {args.num_attention_heads}; "
            "give the head dimension with --kv-channels")
    require(args.kv_channels is None or args.kv_channels >= 1, f"--kv-channels {args.kv_channels} must be at least 1")
    if args.ffn_hidden_size is None:
        args.ffn_hidden_size = default_ffn_hidden_size(args.hidden_size, args.swiglu)
    require(args.ffn_hidden_size >= 1 and args.ffn_hidden_size % tp == 0,
            f"--ffn-hidden-size {args.ffn_hidden_size} is not a positive multiple of --tensor-model-parallel-size {tp}")
    _check_architecture(args, tp)


def check_positions(args) -> None:
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    require(args.seq_length <= args.max_position_embeddings,
            f"--seq-length {args.seq_length} is longer than --max-position-embeddings {args.max_position_embeddings}")
    if args.attention_backend == "local":
        args.attention_backend = "unfused"
    if args.use_flash_attn:
        require(args.attention_backend in ("auto", "flash"),
                f"--use-flash-attn asks for --attention-backend flash, not {args.attention_backend}; give one of them")
        args.attention_backend = "flash"


def transformer_impl_line(args) -> str:
    """What --transformer-impl selects here, said once at start-up."""
    return (f"--transformer-impl {args.transformer_impl}: megatron_zero's own layers run (Megatron-Core's parameter "
            "layout, the fused kernels listed above); Transformer Engine is not used")


def _check_architecture(args, tp: int) -> None:
    """Grouped-query attention and RoPE settings that can work at this TP size."""
    heads = args.num_attention_heads
    if args.num_query_groups is None:
        args.num_query_groups = 1 if args.group_query_attention else heads
    groups = args.num_query_groups
    args.group_query_attention = groups != heads  # recorded as Megatron-LM reads it (model/architecture.py)
    require(groups >= 1 and heads % groups == 0,
            f"--num-attention-heads {heads} is not divisible by --num-query-groups {groups}")
    require((groups % tp if groups >= tp else tp % groups) == 0,
            f"--num-query-groups {groups} and --tensor-model-parallel-size {tp} must divide one another "
            "(fewer groups than TP ranks replicate each group's key/value heads)")
    head_dim = args.hidden_size // heads
    require((heads + 2 * groups) * head_dim % tp == 0,
            f"the fused QKV size ({heads} + 2 x {groups} groups) x head dim {head_dim} is not divisible by "
            f"--tensor-model-parallel-size {tp}")
    require(0 < args.rotary_percent <= 1, f"--rotary-percent {args.rotary_percent} must lie in (0, 1]")
    require(args.rotary_base >= 1, f"--rotary-base {args.rotary_base} must be positive")
    if args.position_embedding_type == "rope":
        require(int(head_dim * args.rotary_percent) % 2 == 0,
                f"--rotary-percent {args.rotary_percent} of head dim {head_dim} rotates an odd number of "
                "features; RoPE rotates pairs")


def check_recompute(args, tp: int) -> None:
    """--recompute-*, --checkpoint-activations (Megatron-DeepSpeed's), the flash backend's dropout, and
    --sequence-parallel's split of the sequence."""
    if args.checkpoint_activations:
        require(args.recompute_granularity in (None, "full"),
                f"--checkpoint-activations means --recompute-granularity full; it contradicts "
                f"--recompute-granularity {args.recompute_granularity}")
        args.recompute_granularity = "full"
        args.recompute_method = args.recompute_method or "uniform"
    if args.recompute_granularity == "full":
        require(args.recompute_method is not None, "--recompute-granularity full needs --recompute-method uniform or block")
    else:
        require(args.recompute_method is None,
                f"--recompute-method {args.recompute_method} applies only to --recompute-granularity full")
    require(1 <= args.recompute_num_layers <= args.num_layers,
            f"--recompute-num-layers {args.recompute_num_layers} must lie between 1 and --num-layers {args.num_layers}")
    if args.attention_backend == "flash" and args.attention_dropout != 0:
        import torch  # here only: the flags are checked before torch is loaded (a bad flag is refused at once)
        require(torch.cuda.is_available(),
                f"--attention-backend flash with --attention-dropout {args.attention_dropout} needs CUDA: torch has "
                "no flash kernel with dropout on this machine; use --attention-backend auto or --attention-dropout 0")
    require(not args.sequence_parallel or args.seq_length % tp == 0,
            f"--sequence-parallel splits --seq-length {args.seq_length} over --tensor-model-parallel-size {tp}, "
            "which does not divide it")
