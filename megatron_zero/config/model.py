"""The model's flags (sizes, architecture, recompute and attention kernels): their declarations, the
defaults derived from other flags, and the checks at a tensor-parallel size. GPTConfig is built from the
checked flags by model/architecture.py's gpt_config, the one args -> model settings mapping."""
from __future__ import annotations

import argparse
from typing import Optional

from ..model import shape_rules
from ..model.config import NORMALIZATIONS, POSITION_EMBEDDING_TYPES, GPTConfig, default_ffn_hidden_size
from .errors import require
from .fields import add_section_flags, flag, section


def _normalization(text: str) -> str:
    """LayerNorm or RMSNorm, in any case (Megatron-DeepSpeed writes layernorm / rmsnorm)."""
    by_lower = {n.lower(): n for n in NORMALIZATIONS}
    if text.lower() not in by_lower:
        raise argparse.ArgumentTypeError(f"{text!r} is not one of {', '.join(NORMALIZATIONS)}")
    return by_lower[text.lower()]


ARCHITECTURE = "architecture (GPT-2 by default; these give the Llama / Mistral family)"
RECOMPUTE = "recompute and attention kernels"


@section("model sizes")
class ModelConfig:
    """The model's sizes, architecture, recompute and attention kernels, checked (the defaults that follow from
    other flags filled in)."""
    num_layers: int = flag("transformer layers of the model", required=True)
    hidden_size: int = flag("the transformer's hidden width h", required=True)
    num_attention_heads: int = flag("attention heads per layer (query heads with grouped-query attention)",
                                    required=True)
    ffn_hidden_size: Optional[int] = flag("the MLP's inner width (default 4 x --hidden-size; with --swiglu 2/3 of "
                                          "that, rounded down to a multiple of 64)")
    seq_length: int = flag("tokens per training sample", required=True)
    max_position_embeddings: Optional[int] = flag("positions the learned position table holds (default "
                                                  "--seq-length)")
    make_vocab_size_divisible_by: int = flag("pad the vocabulary to a multiple of this x "
                                             "--tensor-model-parallel-size", GPTConfig.make_vocab_size_divisible_by)
    hidden_dropout: float = flag("dropout probability after the attention and MLP outputs", GPTConfig.hidden_dropout)
    attention_dropout: float = flag("dropout probability on the attention weights", GPTConfig.attention_dropout)
    layernorm_epsilon: float = flag("epsilon of LayerNorm / RMSNorm", GPTConfig.layernorm_epsilon,
                                    names=("--layernorm-epsilon", "--norm-epsilon"))
    init_method_std: float = flag("standard deviation of the normal weight initialisation (output projections "
                                  "scaled by 1/sqrt(2 x layers))", GPTConfig.init_method_std)
    normalization: str = flag("the norm of each layer and the final norm: LayerNorm (GPT-2) or RMSNorm (Llama), any "
                              "case", GPTConfig.normalization, group=ARCHITECTURE, type=_normalization,
                              metavar="{LayerNorm,RMSNorm}")
    apply_layernorm_1p: bool = flag("zero-centred norm weights: each norm's weight w starts at 0 and the norm "
                                    "applies 1 + w (Megatron-Core's zero_centered_gamma; LayerNorm and RMSNorm)",
                                    GPTConfig.apply_layernorm_1p, group=ARCHITECTURE, action="store_true")
    position_embedding_type: str = flag(
        "learned_absolute: a learned table (GPT-2); rope: rotary embeddings (Llama)", GPTConfig.position_embedding_type,
        group=ARCHITECTURE, choices=list(POSITION_EMBEDDING_TYPES),
        also=(dict(names=("--use-rotary-position-embeddings",), action="store_const", const="rope",
                   help="Megatron-DeepSpeed's spelling of --position-embedding-type rope"),))
    kv_channels: Optional[int] = flag("each attention head's dimension (default --hidden-size / "
                                      "--num-attention-heads; Qwen3: 128)", group=ARCHITECTURE)
    qk_layernorm: bool = flag("QK-norm: the layer's norm (--normalization) over each head's query and key, before "
                              "RoPE (Qwen3, OLMo 2); one weight per head dimension, shared by the heads",
                              GPTConfig.qk_layernorm, group=ARCHITECTURE, action="store_true")
    rotary_base: int = flag("RoPE's base period theta", GPTConfig.rotary_base, group=ARCHITECTURE)
    rotary_percent: float = flag("the fraction of each head's dimensions RoPE rotates", GPTConfig.rotary_percent,
                                 group=ARCHITECTURE)
    swiglu: bool = flag("the MLP's activation is SwiGLU (two input projections, Llama) instead of GeLU",
                        GPTConfig.swiglu, group=ARCHITECTURE, action="store_true")
    group_query_attention: bool = flag("grouped-query attention with --num-query-groups (default 1) key/value heads",
                                       False, group=ARCHITECTURE, action="store_true")
    num_query_groups: Optional[int] = flag("key/value heads of grouped-query attention (default: "
                                           "--num-attention-heads, or 1 with --group-query-attention)",
                                           group=ARCHITECTURE, names=("--num-query-groups", "--num-key-value-heads"))
    untie_embeddings_and_output_weights: bool = flag("an output layer of its own instead of the word embedding's "
                                                     "transpose", GPTConfig.untie_embeddings_and_output_weights,
                                                     group=ARCHITECTURE, action="store_true")
    add_bias_linear: bool = flag("no biases on the linear layers (Llama)", GPTConfig.add_bias_linear,
                                 group=ARCHITECTURE, names=("--disable-bias-linear",), action="store_false")
    add_qkv_bias: bool = flag("a bias on the QKV projection also with --disable-bias-linear (Qwen2)",
                              GPTConfig.add_qkv_bias, group=ARCHITECTURE, action="store_true")
    recompute_granularity: Optional[str] = flag("recompute activations in backward: whole layers (full) or the "
                                                "attention core (selective)", group=RECOMPUTE,
                                                choices=["full", "selective"])
    recompute_method: Optional[str] = flag("full recompute: chunks of --recompute-num-layers layers (uniform), or "
                                           "only the first --recompute-num-layers layers of each pipeline stage "
                                           "(block)", group=RECOMPUTE, choices=["uniform", "block"])
    recompute_num_layers: int = flag("full recompute: layers per recomputed chunk (uniform) or recomputed layers per "
                                     "stage (block)", GPTConfig.recompute_num_layers, group=RECOMPUTE,
                                     names=("--recompute-num-layers", "--checkpoint-num-layers"))
    checkpoint_activations: bool = flag("Megatron-DeepSpeed's name for --recompute-granularity full "
                                        "--recompute-method uniform", False, group=RECOMPUTE, action="store_true")
    attention_backend: str = flag("auto: torch's scaled_dot_product_attention where it applies, else unfused; "
                                  "flash: only its kernels that never build the s x s matrix; fused: the fused "
                                  "causal-softmax kernel; unfused (Megatron's local): matmul, causal softmax, matmul",
                                  GPTConfig.attention_backend, group=RECOMPUTE,
                                  choices=["auto", "flash", "fused", "unfused", "local"])
    use_flash_attn: bool = flag("Megatron-LM's older switch for FlashAttention: --attention-backend flash", False,
                                group=RECOMPUTE, action="store_true")
    transformer_impl: Optional[str] = flag("Megatron-LM's choice of layer implementation; either way this build's "
                                           "own layers run (Megatron-Core's parameter layout, the csrc/ fused "
                                           "kernels; Transformer Engine is not used), and the run says so in one "
                                           "line", group=RECOMPUTE, choices=["local", "transformer_engine"])


def add_flags(p: argparse.ArgumentParser) -> None:
    add_section_flags(p, ModelConfig)


def check_sizes(args) -> None:
    """The model's sizes are positive (the parallel sizes: parallel.py)."""
    for name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length"):
        value = getattr(args, name)
        require(value >= 1, f"--{name.replace('_', '-')} must be at least 1, got {value}")


def check(args, tp: int) -> None:
    """Heads, widths and positions that work at tensor-parallel size `tp`; fills --ffn-hidden-size and
    --max-position-embeddings' defaults, --num-query-groups and the recompute switches."""
    shape_rules.heads_split(args.num_attention_heads, tp)
    shape_rules.head_dim_given(args.hidden_size, args.num_attention_heads, args.kv_channels)
    if args.ffn_hidden_size is None:
        args.ffn_hidden_size = default_ffn_hidden_size(args.hidden_size, args.swiglu)
    shape_rules.ffn_split(args.ffn_hidden_size, tp)
    _check_architecture(args, tp)


def check_positions(args) -> None:
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    shape_rules.positions(args.seq_length, args.max_position_embeddings)
    if args.attention_backend == "local":
        args.attention_backend = "unfused"
    if args.use_flash_attn:
        require(args.attention_backend in ("auto", "flash"),
                f"--use-flash-attn asks for --attention-backend flash, not {args.attention_backend}; give one of them")
        args.attention_backend = "flash"


def transformer_impl_line(model: ModelConfig) -> str:
    """What --transformer-impl selects here, said once at start-up."""
    return (f"--transformer-impl {model.transformer_impl}: megatron_zero's own layers run (Megatron-Core's parameter "
            "layout, the fused kernels listed above); Transformer Engine is not used")


def _check_architecture(args, tp: int) -> None:
    """Grouped-query attention and RoPE settings that can work at this TP size."""
    heads = args.num_attention_heads
    if args.num_query_groups is None:
        args.num_query_groups = 1 if args.group_query_attention else heads
    groups = args.num_query_groups
    args.group_query_attention = groups != heads  # recorded as Megatron-LM reads it (model/architecture.py)
    shape_rules.query_groups(heads, groups)
    shape_rules.query_groups_split(groups, tp)
    head_dim = args.kv_channels or args.hidden_size // heads  # GPTConfig.head_dim
    shape_rules.qkv_split(heads, groups, head_dim, tp)
    shape_rules.rotary_percent_range(args.rotary_percent)
    require(args.rotary_base >= 1, f"--rotary-base {args.rotary_base} must be positive")
    if args.position_embedding_type == "rope" and not args.multi_latent_attention:  # MLA's: config/mla.py
        shape_rules.rope_pairs(args.rotary_percent, head_dim)


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
        shape_rules.full_recompute_method(args.recompute_granularity, args.recompute_method)
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
    shape_rules.sequence_split(args.seq_length, tp, args.sequence_parallel)
