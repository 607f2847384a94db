"""LlamaForCausalLM <-> our GPT with the Llama switches (RMSNorm, RoPE, SwiGLU, grouped-query attention).

Pieces map one to one apart from two fusions of ours: the QKV weight is Megatron's grouped layout
(per query group: its q heads, then its k head, then its v head; HF keeps q_proj, k_proj and
v_proj apart), and SwiGLU's dense_h_to_4h is [gate_proj; up_proj]. RoPE is `rotate_half` on both
sides, so q and k need no permutation. The output layer is untied (`lm_head.weight`) unless
`tie_word_embeddings`. Linear biases exist on both sides or on neither (HF's attention_bias and
mlp_bias must agree: our --disable-bias-linear covers every linear layer). Rope scaling (Llama-3.1's
"llama3" type and others) is refused: our RoPE has no scaling. mistral.py reuses all of this.
"""
from __future__ import annotations

from typing import List

import torch

from ....model.config import GPTConfig
from ....model.layer_indices import block_layer_index, final_norm_index
from ....model.params import lm_head_name, word_embeddings_name
from ...errors import CheckpointError
from .mapping import TensorMapping, base_flags, same

HF_ARCHITECTURE = "LlamaForCausalLM"
MODEL_TYPE = "llama"
SKIPPED_HF = (r"(^|\.)rotary_emb\.inv_freq$", r"^lm_head\.weight$")  # a buffer; the tied head's saved copy
PRESERVED_HF = ()  # config.json keys that our config does not hold, carried from an import to its export


def rope_theta(hf: dict, refuse) -> float:
    """rope_theta from a config.json of any transformers version (top level, or rope_parameters)."""
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or {}
    for what in (params, scaling):
        kind = what.get("rope_type", what.get("type", "default"))
        if kind != "default":
            refuse(f"rope scaling of type {kind!r}")
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    return int(theta) if float(theta).is_integer() else float(theta)


def config_from_hf(hf: dict, what: str = "Llama") -> GPTConfig:
    def refuse(feature):
        raise CheckpointError(f"this {what} config has {feature}, which our GPT does not implement")

    if hf.get("hidden_act", "silu") != "silu":
        refuse(f"hidden_act {hf['hidden_act']!r} (supported: silu)")
    bias = bool(hf.get("attention_bias", False))
    if bias != bool(hf.get("mlp_bias", bias)):
        refuse("biases in the attention layers but not the MLP, or the reverse")
    heads, hidden = hf["num_attention_heads"], hf["hidden_size"]
    head_dim = hf.get("head_dim")
    if head_dim is None and hidden % heads:
        refuse(f"hidden_size {hidden} not divisible by num_attention_heads {heads} and no head_dim")
    theta = rope_theta(hf, refuse)
    positions = hf.get("max_position_embeddings", 2048)
    return GPTConfig(vocab_size=hf["vocab_size"], hidden_size=hidden, num_layers=hf["num_hidden_layers"],
                     num_attention_heads=heads, num_query_groups=hf.get("num_key_value_heads") or heads,
                     seq_length=positions, max_position_embeddings=positions,
                     ffn_hidden_size=hf["intermediate_size"], layernorm_epsilon=hf.get("rms_norm_eps", 1e-6),
                     hidden_dropout=0.0, attention_dropout=float(hf.get("attention_dropout", 0.0)),  # no hidden one
                     init_method_std=hf.get("initializer_range", 0.02), normalization="RMSNorm",
                     position_embedding_type="rope", rotary_base=theta, swiglu=True,
                     untie_embeddings_and_output_weights=not hf.get("tie_word_embeddings", False),
                     add_bias_linear=bias, kv_channels=None if head_dim in (None, hidden // heads) else head_dim)


def flags(config: GPTConfig) -> List[str]:
    out = base_flags(config) + ["--normalization", "RMSNorm", "--position-embedding-type", "rope",
                                "--rotary-base", str(config.rotary_base), "--swiglu", "--group-query-attention",
                                "--num-query-groups", str(config.num_query_groups)]
    if config.kv_channels:
        out += ["--kv-channels", str(config.kv_channels)]
    if config.untie_embeddings_and_output_weights:
        out.append("--untie-embeddings-and-output-weights")
    if not config.add_bias_linear:
        out.append("--disable-bias-linear")
    return out


def matches(config: GPTConfig, qk_layernorm: bool = False) -> bool:
    """Llama's switches (`qk_layernorm`: whether the architecture has QK-norm: Qwen3's, or none: Llama's)."""
    return (config.normalization == "RMSNorm" and config.position_embedding_type == "rope" and config.swiglu
            and config.rotary_percent == 1.0 and config.num_experts is None and not config.add_qkv_bias
            and config.qk_layernorm == qk_layernorm)


def hf_config(config: GPTConfig) -> dict:
    return {
        "architectures": [HF_ARCHITECTURE], "model_type": MODEL_TYPE,
        "vocab_size": config.vocab_size, "hidden_size": config.hidden_size,
        "intermediate_size": config.ffn_hidden_size, "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_attention_heads, "num_key_value_heads": config.num_query_groups,
        "head_dim": config.head_dim, "hidden_act": "silu", "max_position_embeddings": config.max_position_embeddings,
        "initializer_range": config.init_method_std, "rms_norm_eps": config.layernorm_epsilon,
        "rope_theta": float(config.rotary_base), "attention_bias": config.add_bias_linear,
        "mlp_bias": config.add_bias_linear, "attention_dropout": 0.0,
        "tie_word_embeddings": not config.untie_embeddings_and_output_weights,
    }


def _qkv(name: str, hf_names, config: GPTConfig) -> TensorMapping:
    """q_proj, k_proj, v_proj <-> per query group [q heads of the group, k head, v head] rows."""
    groups, hd = config.num_query_groups, config.head_dim
    q_rows = config.num_attention_heads // groups * hd

    def to_ours(ts):
        q, k, v = ts
        rest = q.shape[1:]
        return torch.cat([q.reshape(groups, q_rows, *rest), k.reshape(groups, hd, *rest),
                          v.reshape(groups, hd, *rest)], dim=1).reshape(-1, *rest)

    def to_hf(t):
        rest = t.shape[1:]
        q, k, v = t.reshape(groups, q_rows + 2 * hd, *rest).split([q_rows, hd, hd], dim=1)
        return [x.reshape(-1, *rest) for x in (q, k, v)]
    return TensorMapping(name, tuple(hf_names), to_ours, to_hf)


def _gate_up(name: str, hf_names) -> TensorMapping:
    """gate_proj, up_proj <-> SwiGLU's [gate; up]."""
    return TensorMapping(name, tuple(hf_names), lambda ts: torch.cat(ts), lambda t: list(t.chunk(2)))


def mlp_mappings(ours: str, hf: str, kinds, names=("gate_proj", "up_proj", "down_proj")) -> List[TensorMapping]:
    """A SwiGLU MLP: ours `{ours}dense_h_to_4h.*` = [gate; up], `{ours}dense_4h_to_h.*` = down, under `hf`."""
    gate, up, down = names
    return ([_gate_up(f"{ours}dense_h_to_4h.{k}", [f"{hf}{gate}.{k}", f"{hf}{up}.{k}"]) for k in kinds]
            + [same(f"{ours}dense_4h_to_h.{k}", f"{hf}{down}.{k}") for k in kinds])


def dense_block_mlp(config: GPTConfig, block: int, ours: str, hf: str) -> List[TensorMapping]:
    """Block `block`'s MLP (ours: `{i}.`, HF: `model.layers.{b}.`)."""
    return mlp_mappings(ours + "mlp.", hf + "mlp.", ("weight", "bias") if config.add_bias_linear else ("weight",))


def block_attention(config: GPTConfig, ours: str, hf: str) -> List[TensorMapping]:
    """A block's attention (ours: `{i}.`, HF: `model.layers.{b}.`): q, k, v <-> the fused QKV, o_proj <-> dense."""
    kinds = ("weight", "bias") if config.add_bias_linear else ("weight",)
    qkv_kinds = ("weight", "bias") if config.add_bias_linear or config.add_qkv_bias else ("weight",)
    out = [_qkv(ours + f"self_attention.query_key_value.{k}", [hf + f"self_attn.{p}_proj.{k}" for p in "qkv"], config)
           for k in qkv_kinds]
    return out + [same(ours + f"self_attention.dense.{k}", hf + f"self_attn.o_proj.{k}") for k in kinds]


def tensor_mappings(config: GPTConfig, block_mlp=dense_block_mlp, attention=block_attention) -> List[TensorMapping]:
    """`block_mlp(config, block, our prefix, HF prefix)`: a block's MLP mappings (an MoE architecture's own);
    `attention(config, our prefix, HF prefix)`: its attention's (multi-latent attention's: deepseek_v3.py)."""
    out = [same(word_embeddings_name(config), "model.embed_tokens.weight")]
    for b in range(config.num_layers):
        i, h = f"{block_layer_index(b)}.", f"model.layers.{b}."
        out.append(same(i + "input_layernorm.weight", h + "input_layernorm.weight"))
        out += attention(config, i, h)
        out.append(same(i + "post_attention_layernorm.weight", h + "post_attention_layernorm.weight"))
        out += block_mlp(config, b, i, h)
    out.append(same(f"{final_norm_index(config.num_layers)}.weight", "model.norm.weight"))
    if config.untie_embeddings_and_output_weights:
        out.append(same(lm_head_name(config), "lm_head.weight"))
    return out
