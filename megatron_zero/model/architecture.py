"""The model a set of training arguments describes, in one spelling, whoever wrote the arguments.

    settings = model_settings(args)                  # parsed flags, or the args a checkpoint records
    config = gpt_config(args, vocab_size)            # GPTConfig: the one args -> model settings mapping

Three writers record arguments: this trainer and its Hugging Face importer, Megatron-LM and
Megatron-DeepSpeed. They spell some settings differently and leave some implied; every reader of
recorded args (the resume check, the saved-config readers) and the run's own flags go through
`model_settings`, so both sides of a comparison are derived by the same rules:

    setting                   recorded as                                   implied when absent
    position_embedding_type   position_embedding_type (ours, Megatron-LM);  learned_absolute
                              use_rotary_position_embeddings (legacy, -DS)
    add_position_embedding    position_embedding_type decides where it is   True (GPT-2)
                              recorded; else Megatron-DeepSpeed's own switch
    normalization             LayerNorm / RMSNorm in any case (-DS: rmsnorm) LayerNorm
    apply_layernorm_1p        apply_layernorm_1p; False where Megatron-     False
                              DeepSpeed recorded it beside its rmsnorm
                              (whose RMSNorm ignores the switch)
    num_query_groups          num_query_groups; Megatron-DeepSpeed's        num_attention_heads
                              num_key_value_heads; Megatron-LM's default 1
                              without group_query_attention means none
    layernorm_epsilon         layernorm_epsilon; Megatron-LM's norm_epsilon -
    ffn_hidden_size           ffn_hidden_size                               4h, or 2/3 of it with SwiGLU
    max_position_embeddings   max_position_embeddings                       seq_length
    the other switches        swiglu, untie_embeddings_and_output_weights,  their GPT-2 values (SWITCHES)
                              add_bias_linear, apply_residual_connection_
                              post_layernorm
    add_qkv_bias              add_qkv_bias (Megatron-LM's)                  False
    qk_layernorm              qk_layernorm (Megatron-LM's)                  False
    mtp_num_layers            mtp_num_layers (Megatron-LM's; 0 is none)     None
    kv_channels               kv_channels (Megatron-LM's; hidden / heads    hidden / heads
                              is read as unset)
    multi_latent_attention    multi_latent_attention and its sizes          False (the sizes: not compared)
                              (Megatron-LM's names: q_lora_rank, ...)
    shared expert             moe_shared_expert_intermediate_size,          none (no shared expert)
                              moe_shared_expert_gate (Megatron-Core's)

`fill_sizes=False` leaves the three sizes None when unrecorded (a reader that can take them from
tensor shapes prefers those); the switches always get a value.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import List, Optional, Union

from .config import NORMALIZATIONS, GPTConfig, default_ffn_hidden_size

# the GPT-2 value of every architecture switch: what a checkpoint that does not record one holds
SWITCHES = {"swiglu": False, "normalization": "LayerNorm", "untie_embeddings_and_output_weights": False,
            "add_bias_linear": True, "apply_residual_connection_post_layernorm": False,
            "position_embedding_type": "learned_absolute", "add_position_embedding": True,
            "apply_layernorm_1p": False, "moe_shared_expert_intermediate_size": None, "moe_shared_expert_gate": False,
            "add_qkv_bias": False, "qk_layernorm": False, "multi_latent_attention": False,
            "mtp_num_layers": None}
# sizes and numbers of the model (compared where both sides have one)
SIZES = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "max_position_embeddings",
         "make_vocab_size_divisible_by", "layernorm_epsilon", "num_query_groups", "rotary_base", "rotary_percent", "kv_channels",
         "q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim")


def _normalization(value) -> str:
    by_lower = {n.lower(): n for n in NORMALIZATIONS}
    return by_lower.get(str(value).lower(), value)


def _query_groups(args: dict, heads: Optional[int]) -> Optional[int]:
    groups = args.get("num_query_groups")
    if groups is None:
        groups = args.get("num_key_value_heads")
    if groups is not None and args.get("group_query_attention") is False and groups == 1:
        groups = None  # Megatron-LM's default, which it ignores without --group-query-attention
    return heads if groups is None else int(groups)


def model_settings(args, fill_sizes: bool = True) -> dict:
    """Every setting of SWITCHES and SIZES that `args` (a dict or Namespace) records or implies; None for a
    size it neither records nor implies."""
    args = dict(args) if isinstance(args, dict) else dict(vars(args))
    out = {key: args.get(key) for key in SIZES}
    for key, gpt2 in SWITCHES.items():
        out[key] = gpt2 if args.get(key) is None else args[key]
    out["normalization"] = _normalization(out["normalization"])
    out["mtp_num_layers"] = out["mtp_num_layers"] or None
    if args.get("normalization") == "rmsnorm":  # Megatron-DeepSpeed's RMSNorm trains gamma as is, 1p or not
        out["apply_layernorm_1p"] = False
    if args.get("use_rotary_position_embeddings"):
        out["position_embedding_type"] = "rope"
    # where the type is recorded (ours, Megatron-LM) it decides; Megatron-DeepSpeed's own switch stands otherwise
    if args.get("position_embedding_type") is not None:
        out["add_position_embedding"] = out["position_embedding_type"] == "learned_absolute"
    if out["layernorm_epsilon"] is None:
        out["layernorm_epsilon"] = args.get("norm_epsilon")
    heads = args.get("num_attention_heads")
    out["num_query_groups"] = _query_groups(args, heads if fill_sizes else None)
    if heads and out["kv_channels"] is not None and args.get("hidden_size") is not None \
            and out["kv_channels"] * heads == args["hidden_size"]:
        out["kv_channels"] = None  # Megatron-LM records the default head dimension; the same model as unset
    if fill_sizes:
        if out["ffn_hidden_size"] is None and args.get("hidden_size") is not None:
            out["ffn_hidden_size"] = default_ffn_hidden_size(args["hidden_size"], bool(out["swiglu"]))
        if out["max_position_embeddings"] is None:
            out["max_position_embeddings"] = args.get("seq_length")
    return out


# the mixture-of-experts structure (compared on resume; the router (top-k, gating) may change): num_experts None
# is a dense model; the rest are compared where both sides have MoE layers and record the setting
MOE_STRUCTURE = ("moe_layer_freq", "moe_layer_offset", "moe_ffn_hidden_size")


def moe_settings(args) -> dict:
    """num_experts (None: dense; Megatron-DeepSpeed's one-element list read as its number) and, for an MoE
    model, each MOE_STRUCTURE setting it records (None where it does not)."""
    args = dict(args) if isinstance(args, dict) else dict(vars(args))
    experts = args.get("num_experts")
    if isinstance(experts, (list, tuple)):
        experts = experts[0] if len(set(experts)) == 1 else list(experts)
    if experts in (None, 1, [1]) and not args.get("moe_capacity_factor"):
        return {"num_experts": None}  # Megatron-DeepSpeed records [1] for a dense model
    out = {"num_experts": experts, **{k: args.get(k) for k in MOE_STRUCTURE}}
    if isinstance(out["moe_layer_freq"], list):  # a pattern, as a checkpoint's JSON or Megatron-LM's args hold it
        out["moe_layer_freq"] = tuple(out["moe_layer_freq"])
    return out


@dataclass(frozen=True)
class ModelSettings:
    """The model a run's arguments describe, typed: model_settings' and moe_settings' values as fields (None
    where a size is neither recorded nor implied; the MoE structure None for a dense model). The resume check
    (checkpoint/compat.py) builds one from the checkpoint's args and one from the run's flags and compares them."""
    num_layers: Optional[int]
    hidden_size: Optional[int]
    num_attention_heads: Optional[int]
    ffn_hidden_size: Optional[int]
    max_position_embeddings: Optional[int]
    make_vocab_size_divisible_by: Optional[int]
    layernorm_epsilon: Optional[float]
    num_query_groups: Optional[int]
    rotary_base: Optional[float]
    rotary_percent: Optional[float]
    kv_channels: Optional[int]
    swiglu: bool
    normalization: str
    untie_embeddings_and_output_weights: bool
    add_bias_linear: bool
    apply_residual_connection_post_layernorm: bool
    position_embedding_type: str
    add_position_embedding: bool
    apply_layernorm_1p: bool
    moe_shared_expert_intermediate_size: Optional[int]
    moe_shared_expert_gate: bool
    add_qkv_bias: bool
    qk_layernorm: bool
    multi_latent_attention: bool
    q_lora_rank: Optional[int]
    kv_lora_rank: Optional[int]
    qk_head_dim: Optional[int]
    qk_pos_emb_head_dim: Optional[int]
    v_head_dim: Optional[int]
    num_experts: Union[None, int, List[int]]  # None: dense
    moe_layer_freq: Optional[object] = None  # an interval or a per-layer pattern, as recorded
    moe_layer_offset: Optional[int] = None
    moe_ffn_hidden_size: Optional[int] = None
    mtp_num_layers: Optional[int] = None  # multi-token prediction's depths (None: none)

    @classmethod
    def from_args(cls, args) -> "ModelSettings":
        """From parsed flags or the args a checkpoint records (a dict or Namespace), in any writer's spelling."""
        return cls(**model_settings(args), **moe_settings(args))


ARCHITECTURE_FIELDS = ("normalization", "apply_layernorm_1p", "position_embedding_type", "rotary_base",
                       "rotary_percent", "swiglu", "num_query_groups", "untie_embeddings_and_output_weights",
                       "add_bias_linear", "add_qkv_bias", "qk_layernorm", "kv_channels")


def architecture_kwargs(args: dict) -> dict:
    """The architecture fields of GPTConfig from a training run's arguments (parsed, or saved in a checkpoint,
    in any writer's spelling: model/architecture.py); a checkpoint from before these flags existed gives GPT-2."""
    settings = model_settings(args)
    return {k: settings[k] for k in ARCHITECTURE_FIELDS if settings.get(k) is not None}


def gpt_config(args, vocab_size: int) -> GPTConfig:
    """GPTConfig from a training run's arguments (checked flags, or the args a checkpoint records, in any
    writer's spelling) and the unpadded vocabulary size: each field from the argument of its name, the
    architecture's through model_settings; a field the arguments lack (or hold as None) keeps its default."""
    args = dict(args) if isinstance(args, dict) else dict(vars(args))
    settings = {**args, **architecture_kwargs(args)}
    keep = {f.name for f in fields(GPTConfig)} - {"vocab_size", "params_dtype"}
    return GPTConfig(vocab_size=vocab_size, **{k: settings[k] for k in keep if settings.get(k) is not None})
