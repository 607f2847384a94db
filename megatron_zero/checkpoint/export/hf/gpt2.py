"""GPT2LMHeadModel <-> our GPT (the default architecture: LayerNorm, learned positions, tanh GeLU, biases, tied head).

Pieces map one to one. Hugging Face's Conv1D stores weights as [in, out] (we: [out, in]);
its fused c_attn output is [q (all heads) | k | v] while ours is per head ([heads, (q, k, v),
head_dim]); the vocabulary is the unpadded one on both sides. The causal-mask buffers of old
`.bin` files (`attn.bias`, `attn.masked_bias`) and a saved copy of the tied `lm_head.weight` are not
parameters and are skipped.
"""
from __future__ import annotations

from typing import List

from ....model.config import GPTConfig
from ....model.layer_indices import block_layer_index, final_norm_index
from ....model.params import POSITION_EMBEDDINGS, WORD_EMBEDDINGS
from ...errors import CheckpointError
from .mapping import TensorMapping, base_flags, same, transposed

HF_ARCHITECTURE = "GPT2LMHeadModel"
MODEL_TYPE = "gpt2"
SKIPPED_HF = (r"(^|\.)attn\.(masked_)?bias$", r"^lm_head\.weight$")
PRESERVED_HF = ()
ACTIVATIONS = ("gelu_new", "gelu_pytorch_tanh")  # the same tanh GeLU


def config_from_hf(hf: dict) -> GPTConfig:
    def refuse(what):
        raise CheckpointError(f"this GPT-2 config has {what}, which our GPT does not implement")

    if hf.get("activation_function", "gelu_new") not in ACTIVATIONS:
        refuse(f"activation_function {hf['activation_function']!r} (supported: {', '.join(ACTIVATIONS)})")
    if not hf.get("scale_attn_weights", True) or hf.get("scale_attn_by_inverse_layer_idx", False):
        refuse("non-standard attention scaling (scale_attn_weights false or scale_attn_by_inverse_layer_idx true)")
    if not hf.get("tie_word_embeddings", True):
        refuse("an output layer untied from the word embedding")
    n_positions = hf.get("n_positions", 1024)
    return GPTConfig(vocab_size=hf["vocab_size"], hidden_size=hf["n_embd"], num_layers=hf["n_layer"],
                     num_attention_heads=hf["n_head"], seq_length=n_positions, max_position_embeddings=n_positions,
                     ffn_hidden_size=hf.get("n_inner") or 4 * hf["n_embd"],
                     layernorm_epsilon=hf.get("layer_norm_epsilon", 1e-5),
                     hidden_dropout=float(hf.get("resid_pdrop", 0.1)),  # ours also drops out the embedding's output
                     attention_dropout=float(hf.get("attn_pdrop", 0.1)),
                     init_method_std=hf.get("initializer_range", 0.02))


def flags(config: GPTConfig) -> List[str]:
    return base_flags(config)


# config fields that other architectures switch (absent from GPTConfig before they exist), at GPT-2's values
GPT2_SWITCHES = {"normalization": "LayerNorm", "position_embedding_type": "learned_absolute", "swiglu": False,
                 "untie_embeddings_and_output_weights": False, "add_bias_linear": True, "num_experts": None}


def matches(config: GPTConfig) -> bool:
    return all(getattr(config, k, v) == v for k, v in GPT2_SWITCHES.items()) and \
        getattr(config, "num_query_groups", None) in (None, config.num_attention_heads) and \
        not getattr(config, "qk_layernorm", False) and getattr(config, "kv_channels", None) is None


def hf_config(config: GPTConfig) -> dict:
    return {
        "architectures": [HF_ARCHITECTURE], "model_type": MODEL_TYPE,
        "vocab_size": config.vocab_size, "n_positions": config.max_position_embeddings,
        "n_embd": config.hidden_size, "n_layer": config.num_layers, "n_head": config.num_attention_heads,
        "n_inner": config.ffn_hidden_size, "activation_function": "gelu_new",
        "layer_norm_epsilon": config.layernorm_epsilon, "initializer_range": config.init_method_std,
        "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "scale_attn_weights": True,
        "tie_word_embeddings": True,
    }


def _qkv(name: str, hf_name: str, heads: int, conv1d: bool) -> TensorMapping:
    """c_attn ([in, q|k|v] for the weight) <-> our per-head [heads * (q, k, v) * head_dim, ...]."""
    def to_ours(ts):
        t = ts[0].t() if conv1d else ts[0]
        return t.reshape(3, heads, -1, *t.shape[1:]).transpose(0, 1).reshape(t.shape)

    def to_hf(t):
        hf = t.reshape(heads, 3, -1, *t.shape[1:]).transpose(0, 1).reshape(t.shape)
        return [hf.t() if conv1d else hf]
    return TensorMapping(name, (hf_name,), to_ours, to_hf)


def tensor_mappings(config: GPTConfig) -> List[TensorMapping]:
    heads, out = config.num_attention_heads, [same(WORD_EMBEDDINGS, "transformer.wte.weight"),
                                              same(POSITION_EMBEDDINGS, "transformer.wpe.weight")]
    for b in range(config.num_layers):
        i, h = f"{block_layer_index(b)}.", f"transformer.h.{b}."
        out += [same(i + "input_layernorm.weight", h + "ln_1.weight"),
                same(i + "input_layernorm.bias", h + "ln_1.bias"),
                _qkv(i + "self_attention.query_key_value.weight", h + "attn.c_attn.weight", heads, True),
                _qkv(i + "self_attention.query_key_value.bias", h + "attn.c_attn.bias", heads, False),
                transposed(i + "self_attention.dense.weight", h + "attn.c_proj.weight"),
                same(i + "self_attention.dense.bias", h + "attn.c_proj.bias"),
                same(i + "post_attention_layernorm.weight", h + "ln_2.weight"),
                same(i + "post_attention_layernorm.bias", h + "ln_2.bias"),
                transposed(i + "mlp.dense_h_to_4h.weight", h + "mlp.c_fc.weight"),
                same(i + "mlp.dense_h_to_4h.bias", h + "mlp.c_fc.bias"),
                transposed(i + "mlp.dense_4h_to_h.weight", h + "mlp.c_proj.weight"),
                same(i + "mlp.dense_4h_to_h.bias", h + "mlp.c_proj.bias")]
    f = final_norm_index(config.num_layers)
    return out + [same(f"{f}.weight", "transformer.ln_f.weight"), same(f"{f}.bias", "transformer.ln_f.bias")]

