"""The parameter catalogue: every parameter's name, full (unsharded) shape, TP split and init.

Names are Megatron-DeepSpeed's pipeline names (GPTModelPipe):

    tied (GPT-2)                                   untied (--untie-embeddings-and-output-weights)
    tied_modules.embed.word_embeddings.weight      1.word_embeddings.weight
    tied_modules.embed.position_embeddings.weight  1.position_embeddings.weight   (learned positions only)
    (the output head reuses the word embedding)    {L+3}.lm_head.weight           (last stage, vocab-parallel)

Block parameters are `{i}.<suffix>` with the suffixes of BLOCK_PARAMS; the config decides which
exist (no `*.bias` of a linear layer with add_bias_linear=False, but the QKV bias with add_qkv_bias; no norm
bias with RMSNorm; `self_attention.q_layernorm.*` / `k_layernorm.*` [head_dim], replicated, with qk_layernorm).
With multi-latent attention (model/mla.py) the attention holds Megatron-Core's projections in place of
query_key_value: `linear_q_down_proj` [q_lora_rank, h] and `linear_kv_down_proj` [kv_lora_rank + pos, h]
replicated, `linear_q_up_proj` [heads (qk + pos), q_lora_rank] (or, without a q latent, `linear_q_proj`
[heads (qk + pos), h]) and `linear_kv_up_proj` [heads (qk + v), kv_lora_rank] split over heads (rows), the
output `dense` [h, heads v]; with qk_layernorm `q_layernorm.*` [q_lora_rank] and `kv_layernorm.*` [kv_lora_rank].
The final norm is `{L+2}.weight` (and `{L+2}.bias` for LayerNorm). With `apply_layernorm_1p` a norm weight
holds w, zero-centred (initialised to 0), and the norm applies gamma = 1 + w (Megatron-Core's
zero_centered_gamma); every tensor of our own formats holds w, an exporter converts where a format holds gamma.
An MoE block (config.is_moe_layer) has, in place of `mlp.*`, DeepSpeed-MoE's names with global expert ids
(the same whatever the expert-parallel layout): `mlp.deepspeed_moe.gate.wg.weight` [E, h] (the router,
replicated) and per expert e `mlp.deepspeed_moe.experts.deepspeed_experts.{e}.dense_h_to_4h.*` /
`.dense_4h_to_h.*`, split across TP as the dense MLP's, of width moe_ffn_hidden_size; with a shared expert
(moe/shared_expert.py) also `mlp.shared_expert.dense_h_to_4h.*` / `.dense_4h_to_h.*` (the dense MLP's split,
width moe_shared_expert_intermediate_size) and with its gate `mlp.shared_expert_gate.weight` [1, h] (replicated).

With multi-token prediction (model/multi_token_prediction.py) the layer `{L+4}` holds, per depth k,
Megatron-Core's MultiTokenPredictionLayer: `{L+4}.{k}.enorm.*` and `.hnorm.*` (the model's norm, [h]),
`{L+4}.{k}.eh_proj.weight` [h, 2h] (column-parallel), `{L+4}.{k}.transformer_layer.<the last block's suffix>`
(split as a block's; where the last block is MoE, its router, experts under global ids and shared expert, as
Megatron-Core builds the MTP layer from the decoder's last layer spec) and `{L+4}.{k}.final_layernorm.*`; the
embedding and output layer are the model's (a last pipeline stage holds a copy of an untied embedding too, under its names `1.*`, as of a tied one).

The full shape of a vocabulary tensor is the *unpadded* one, [config.vocab_size, h]; padding
to `config.padded_vocab_size(tp)` happens when a full tensor is sharded. Two full layouts
are fused (see sharding.py for how they split across TP):
* query_key_value: per query group g, [q heads of g, k head of g, v head of g] rows of
  head_dim each (Megatron's layout; GPT-2's per-head [q, k, v] is groups == heads);
* SwiGLU's dense_h_to_4h: [gate (ffn rows); up (ffn rows)], `sub_params=2`: TP rank r holds
  [gate_r; up_r].
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import List, Optional, Tuple

from .config import GPTConfig
from .layer_indices import (EMBEDDING_INDEX, block_layer_index, block_number, final_norm_index, is_block_index, lm_head_index,
                            mtp_index, num_pipeline_layers)

WORD_EMBEDDINGS = "tied_modules.embed.word_embeddings.weight"
POSITION_EMBEDDINGS = "tied_modules.embed.position_embeddings.weight"
UNTIED_WORD_EMBEDDINGS = f"{EMBEDDING_INDEX}.word_embeddings.weight"
UNTIED_POSITION_EMBEDDINGS = f"{EMBEDDING_INDEX}.position_embeddings.weight"
LM_HEAD_SUFFIX = "lm_head.weight"
SWIGLU_SUFFIXES = ("mlp.dense_h_to_4h.weight", "mlp.dense_h_to_4h.bias")

# suffix within a block -> (partition_dim or None, init kind)
BLOCK_PARAMS = {
    "input_layernorm.weight": (None, "ones"),
    "input_layernorm.bias": (None, "zeros"),
    "self_attention.query_key_value.weight": (0, "normal"),
    "self_attention.query_key_value.bias": (0, "zeros"),
    "self_attention.dense.weight": (1, "scaled_normal"),
    "self_attention.dense.bias": (None, "zeros"),
    "self_attention.q_layernorm.weight": (None, "ones"),
    "self_attention.q_layernorm.bias": (None, "zeros"),
    "self_attention.k_layernorm.weight": (None, "ones"),
    "self_attention.k_layernorm.bias": (None, "zeros"),
    # multi-latent attention (model/mla.py) in place of query_key_value and the QK-norm: the down-projections
    # replicated, the up-projections split over heads; q_layernorm and kv_layernorm norm the latents
    "self_attention.linear_q_proj.weight": (0, "normal"),
    "self_attention.linear_q_down_proj.weight": (None, "normal"),
    "self_attention.linear_q_up_proj.weight": (0, "normal"),
    "self_attention.linear_kv_down_proj.weight": (None, "normal"),
    "self_attention.linear_kv_up_proj.weight": (0, "normal"),
    "self_attention.kv_layernorm.weight": (None, "ones"),
    "self_attention.kv_layernorm.bias": (None, "zeros"),
    "post_attention_layernorm.weight": (None, "ones"),
    "post_attention_layernorm.bias": (None, "zeros"),
    "mlp.dense_h_to_4h.weight": (0, "normal"),
    "mlp.dense_h_to_4h.bias": (0, "zeros"),
    "mlp.dense_4h_to_h.weight": (1, "scaled_normal"),
    "mlp.dense_4h_to_h.bias": (None, "zeros"),
}
QK_NORM_SUFFIXES = ("self_attention.q_layernorm.weight", "self_attention.q_layernorm.bias",
                    "self_attention.k_layernorm.weight", "self_attention.k_layernorm.bias")
MLA_SUFFIXES = ("self_attention.linear_q_proj.weight", "self_attention.linear_q_down_proj.weight",
                "self_attention.linear_q_up_proj.weight", "self_attention.linear_kv_down_proj.weight",
                "self_attention.linear_kv_up_proj.weight", "self_attention.kv_layernorm.weight",
                "self_attention.kv_layernorm.bias")
_NORM_BIASES = ("input_layernorm.bias", "post_attention_layernorm.bias", "self_attention.q_layernorm.bias",
                "self_attention.k_layernorm.bias", "self_attention.kv_layernorm.bias")
_NORM_WEIGHTS = ("input_layernorm.weight", "post_attention_layernorm.weight", "self_attention.q_layernorm.weight",
                 "self_attention.k_layernorm.weight", "self_attention.kv_layernorm.weight")
MOE_ROUTER_SUFFIX = "mlp.deepspeed_moe.gate.wg.weight"
MOE_EXPERT_PREFIX = "mlp.deepspeed_moe.experts.deepspeed_experts."
SHARED_EXPERT_PREFIX = "mlp.shared_expert."
SHARED_EXPERT_GATE_SUFFIX = "mlp.shared_expert_gate.weight"
MTP_NORMS = ("enorm", "hnorm", "final_layernorm")
MTP_PROJECTION = "eh_proj.weight"
MTP_LAYER_PREFIX = "transformer_layer."


def expert_suffix(expert: int, mlp_suffix: str) -> str:
    """`mlp.dense_h_to_4h.weight` of expert `expert` -> its name within an MoE block."""
    return f"{MOE_EXPERT_PREFIX}{expert}.{mlp_suffix[len('mlp.'):]}"


def parse_expert_suffix(suffix: str):
    """(expert id, the dense MLP's suffix) of an expert parameter's suffix (a block's, or an MTP depth's
    `{k}.transformer_layer.` + a block's), or None."""
    depth, _, local = suffix.partition(".")
    if depth.isdigit() and local.startswith(MTP_LAYER_PREFIX):
        suffix = local[len(MTP_LAYER_PREFIX):]
    if not suffix.startswith(MOE_EXPERT_PREFIX):
        return None
    expert, _, rest = suffix[len(MOE_EXPERT_PREFIX):].partition(".")
    return (int(expert), "mlp." + rest) if expert.isdigit() else None


_EXPERT_ID = re.compile(r"(?<=\.deepspeed_experts\.)\d+(?=\.)")


def with_expert(name: str, expert: int) -> str:
    """An expert parameter's full name with another expert id (the same layer and weight)."""
    return _EXPERT_ID.sub(str(expert), name, count=1)


@dataclass(frozen=True)
class ParamSpec:
    name: str
    full_shape: Tuple[int, ...]
    partition_dim: Optional[int]  # None: replicated across TP
    init: str                     # 'normal', 'scaled_normal', 'zeros' or 'ones'
    is_vocab: bool = False        # rows are the (padded) vocabulary
    sub_params: int = 1           # >1: the partition dim holds this many equal blocks, each split across TP


def word_embeddings_name(config: GPTConfig) -> str:
    return UNTIED_WORD_EMBEDDINGS if config.untie_embeddings_and_output_weights else WORD_EMBEDDINGS


def position_embeddings_name(config: GPTConfig) -> Optional[str]:
    if not config.has_position_embeddings:
        return None
    return UNTIED_POSITION_EMBEDDINGS if config.untie_embeddings_and_output_weights else POSITION_EMBEDDINGS


def lm_head_name(config: GPTConfig) -> Optional[str]:
    """The untied output layer's weight, or None when the word embedding is the output layer."""
    if not config.untie_embeddings_and_output_weights:
        return None
    return f"{lm_head_index(config.num_layers)}.{LM_HEAD_SUFFIX}"


def block_suffixes(config: GPTConfig, layer_index: Optional[int] = None) -> List[str]:
    """The suffixes a block of this config has, in module order: those of BLOCK_PARAMS, with an MoE block's
    router and experts in place of `mlp.*` (`layer_index`: the block's global index; None: a dense block)."""
    out = []
    for suffix in _dense_block_suffixes(config):
        if suffix.startswith("mlp.") and layer_index is not None and config.is_moe_layer(block_number(layer_index)):
            continue
        out.append(suffix)
    if layer_index is not None and config.is_moe_layer(block_number(layer_index)):
        mlp = [s for s in _dense_block_suffixes(config) if s.startswith("mlp.")]
        out.append(MOE_ROUTER_SUFFIX)
        out += [expert_suffix(e, s) for e in range(config.num_experts) for s in mlp]
        if config.moe_shared_expert_intermediate_size:
            out += [SHARED_EXPERT_PREFIX + s[len("mlp."):] for s in mlp]
            if config.moe_shared_expert_gate:
                out.append(SHARED_EXPERT_GATE_SUFFIX)
    return out


def _mla_suffixes(config: GPTConfig) -> List[str]:
    """MLA's attention parameters in module order (model/mla.py)."""
    p = "self_attention."
    q = ["linear_q_proj.weight"] if config.q_lora_rank is None else ["linear_q_down_proj.weight",
                                                                      "linear_q_up_proj.weight"]
    out = q + ["linear_kv_down_proj.weight", "linear_kv_up_proj.weight", "dense.weight"]
    out += ["dense.bias"] if config.add_bias_linear else []
    norm = ("weight", "bias") if config.has_norm_bias else ("weight",)
    if config.qk_layernorm:
        out += ([f"q_layernorm.{n}" for n in norm] if config.q_lora_rank is not None else [])
        out += [f"kv_layernorm.{n}" for n in norm]
    return [p + s for s in out]


def _dense_block_suffixes(config: GPTConfig) -> List[str]:
    out = []
    for suffix in BLOCK_PARAMS:
        if config.multi_latent_attention and suffix.startswith("self_attention."):
            if suffix == "self_attention.query_key_value.weight":
                out += _mla_suffixes(config)
            continue
        if suffix in MLA_SUFFIXES:
            continue
        if suffix in _NORM_BIASES and not config.has_norm_bias:
            continue
        if suffix in QK_NORM_SUFFIXES and not config.qk_layernorm:
            continue
        if suffix.endswith(".bias") and suffix not in _NORM_BIASES and not config.add_bias_linear:
            if not (config.add_qkv_bias and suffix == "self_attention.query_key_value.bias"):
                continue
        out.append(suffix)
    return out


def _block_shape(suffix: str, c: GPTConfig, expert: bool = False, shared: bool = False) -> Tuple[int, ...]:
    h = c.hidden_size
    if shared:
        return {"mlp.dense_h_to_4h.weight": (c.shared_expert_mlp_in_size(), h),
                "mlp.dense_h_to_4h.bias": (c.shared_expert_mlp_in_size(),),
                "mlp.dense_4h_to_h.weight": (h, c.moe_shared_expert_intermediate_size)}.get(suffix, (h,))
    if c.multi_latent_attention and suffix.startswith("self_attention."):
        heads, q_head_dim = c.num_attention_heads, c.qk_head_dim + c.qk_pos_emb_head_dim
        return {"self_attention.linear_q_proj.weight": (heads * q_head_dim, h),
                "self_attention.linear_q_down_proj.weight": (c.q_lora_rank, h),
                "self_attention.linear_q_up_proj.weight": (heads * q_head_dim, c.q_lora_rank or 0),
                "self_attention.linear_kv_down_proj.weight": (c.kv_lora_rank + c.qk_pos_emb_head_dim, h),
                "self_attention.linear_kv_up_proj.weight": (heads * (c.qk_head_dim + c.v_head_dim), c.kv_lora_rank),
                "self_attention.dense.weight": (h, c.query_projection_size),
                "self_attention.q_layernorm.weight": (c.q_lora_rank,),
                "self_attention.q_layernorm.bias": (c.q_lora_rank,),
                "self_attention.kv_layernorm.weight": (c.kv_lora_rank,),
                "self_attention.kv_layernorm.bias": (c.kv_lora_rank,)}.get(suffix, (h,))
    if expert:
        return {"mlp.dense_h_to_4h.weight": (c.moe_mlp_in_size(), h), "mlp.dense_h_to_4h.bias": (c.moe_mlp_in_size(),),
                "mlp.dense_4h_to_h.weight": (h, c.moe_ffn_hidden_size)}.get(suffix, (h,))
    return {
        "self_attention.query_key_value.weight": (c.qkv_size, h),
        "self_attention.query_key_value.bias": (c.qkv_size,),
        "self_attention.dense.weight": (h, c.query_projection_size),
        "self_attention.q_layernorm.weight": (c.head_dim,),
        "self_attention.q_layernorm.bias": (c.head_dim,),
        "self_attention.k_layernorm.weight": (c.head_dim,),
        "self_attention.k_layernorm.bias": (c.head_dim,),
        "mlp.dense_h_to_4h.weight": (c.mlp_in_size, h),
        "mlp.dense_h_to_4h.bias": (c.mlp_in_size,),
        "mlp.dense_4h_to_h.weight": (h, c.ffn_hidden_size),
    }.get(suffix, (h,))


def _norm_weight_init(config: GPTConfig) -> str:
    """A norm weight starts as gamma 1: stored as 1, or zero-centred (--apply-layernorm-1p) as 0."""
    return "zeros" if config.apply_layernorm_1p else "ones"


def mtp_suffixes(config: GPTConfig) -> List[str]:
    """The parameter suffixes of one MTP depth, in module order (model/multi_token_prediction.py)."""
    def norm(which):
        return [f"{which}.weight"] + ([f"{which}.bias"] if config.has_norm_bias else [])
    last_block = block_layer_index(config.num_layers - 1)  # the depth's block is built as the last one (MoE too)
    return (norm("enorm") + norm("hnorm") + [MTP_PROJECTION]
            + [MTP_LAYER_PREFIX + s for s in block_suffixes(config, last_block)] + norm("final_layernorm"))


def parse_mtp_suffix(suffix: str):
    """(depth, the name within that depth) of an MTP parameter's suffix `{k}.<name>`, or None."""
    depth, _, rest = suffix.partition(".")
    return (int(depth), rest) if depth.isdigit() and rest else None


def _mtp_spec(name: str, local: str, config: GPTConfig) -> ParamSpec:
    h = config.hidden_size
    if local == MTP_PROJECTION:
        return ParamSpec(name, (h, 2 * h), 0, "normal")
    if local.startswith(MTP_LAYER_PREFIX):  # the last block's parameter, shaped and split as one
        spec = param_spec(f"{block_layer_index(config.num_layers - 1)}.{local[len(MTP_LAYER_PREFIX):]}", config)
        return ParamSpec(name, spec.full_shape, spec.partition_dim, spec.init, spec.is_vocab, spec.sub_params)
    init = _norm_weight_init(config) if local.endswith(".weight") else "zeros"
    return ParamSpec(name, (h,), None, init)


def is_embedding_or_output(name: str) -> bool:
    """Megatron's is_embedding_or_output_parameter: the word embedding (either copy of a tied one, on the first
    and the last pipeline stage) and the untied output layer; not the position embedding."""
    return name.endswith("word_embeddings.weight") or name.endswith(LM_HEAD_SUFFIX)


def is_norm_weight(name: str, config: GPTConfig) -> bool:
    """Whether `name` is a norm's weight (gamma): a block's two norms and the final norm."""
    index, _, suffix = name.partition(".")
    if not index.isdigit():
        return False
    i = int(index)
    if i == final_norm_index(config.num_layers):
        return suffix == "weight"
    if i == mtp_index(config.num_layers) and config.mtp_num_layers:
        depth = parse_mtp_suffix(suffix)
        local = depth[1] if depth else ""
        return local in [f"{n}.weight" for n in MTP_NORMS] or local[len(MTP_LAYER_PREFIX):] in _NORM_WEIGHTS
    return is_block_index(i, config.num_layers) and suffix in _NORM_WEIGHTS


def param_spec(name: str, config: GPTConfig) -> ParamSpec:
    """What a parameter is, from its name alone; raises ValueError on a name this model has not."""
    h = config.hidden_size
    if name == word_embeddings_name(config):
        return ParamSpec(name, (config.vocab_size, h), 0, "normal", is_vocab=True)
    if name == position_embeddings_name(config):
        return ParamSpec(name, (config.max_position_embeddings, h), None, "normal")
    if name == lm_head_name(config):
        return ParamSpec(name, (config.vocab_size, h), 0, "normal", is_vocab=True)
    index, _, suffix = name.partition(".")
    if index.isdigit():
        i = int(index)
        if is_block_index(i, config.num_layers) and suffix in block_suffixes(config, i):
            if suffix in (MOE_ROUTER_SUFFIX, SHARED_EXPERT_GATE_SUFFIX):
                rows = config.num_experts if suffix == MOE_ROUTER_SUFFIX else 1
                return ParamSpec(name, (rows, h), None, "normal")
            if suffix.startswith(SHARED_EXPERT_PREFIX):
                mlp = "mlp." + suffix[len(SHARED_EXPERT_PREFIX):]
                dim, init = BLOCK_PARAMS[mlp]
                sub_params = 2 if config.swiglu and mlp in SWIGLU_SUFFIXES else 1
                return ParamSpec(name, _block_shape(mlp, config, shared=True), dim, init, sub_params=sub_params)
            expert = parse_expert_suffix(suffix)
            if expert is not None:
                mlp = expert[1]
                dim, init = BLOCK_PARAMS[mlp]
                sub_params = 2 if config.swiglu and mlp in SWIGLU_SUFFIXES else 1
                return ParamSpec(name, _block_shape(mlp, config, expert=True), dim, init, sub_params=sub_params)
            dim, init = BLOCK_PARAMS[suffix]
            if suffix in _NORM_WEIGHTS:
                init = _norm_weight_init(config)
            sub_params = 2 if config.swiglu and suffix in SWIGLU_SUFFIXES else 1
            return ParamSpec(name, _block_shape(suffix, config), dim, init, sub_params=sub_params)
        if i == mtp_index(config.num_layers) and config.mtp_num_layers:
            depth = parse_mtp_suffix(suffix)
            if depth is not None and depth[0] < config.mtp_num_layers and depth[1] in mtp_suffixes(config):
                return _mtp_spec(name, depth[1], config)
        if i == final_norm_index(config.num_layers) and (suffix == "weight" or
                                                         (suffix == "bias" and config.has_norm_bias)):
            return ParamSpec(name, (h,), None, _norm_weight_init(config) if suffix == "weight" else "zeros")
    raise ValueError(f"{name!r} is not a parameter of this {config.num_layers}-layer model")


def layer_param_names(layer_index: int, config: GPTConfig) -> List[str]:
    L = config.num_layers
    if layer_index == EMBEDDING_INDEX:
        return [n for n in (word_embeddings_name(config), position_embeddings_name(config)) if n]
    if is_block_index(layer_index, L):
        return [f"{layer_index}.{suffix}" for suffix in block_suffixes(config, layer_index)]
    if layer_index == final_norm_index(L):
        return [f"{layer_index}.weight"] + ([f"{layer_index}.bias"] if config.has_norm_bias else [])
    if layer_index == lm_head_index(L) and config.untie_embeddings_and_output_weights:
        return [lm_head_name(config)]
    if layer_index == mtp_index(L) and config.mtp_num_layers:
        return [f"{layer_index}.{k}.{s}" for k in range(config.mtp_num_layers) for s in mtp_suffixes(config)]
    return []


def param_names(config: GPTConfig, layer_indices=None) -> List[str]:
    """Every parameter name of the layers given (default: the whole model), in module order."""
    indices = list(range(num_pipeline_layers(config.num_layers)) if layer_indices is None else layer_indices)
    names = []
    tied = not config.untie_embeddings_and_output_weights
    if (tied or config.mtp_num_layers) and lm_head_index(config.num_layers) in indices and EMBEDDING_INDEX not in indices:
        names += layer_param_names(EMBEDDING_INDEX, config)  # the last stage's copy (tied, or for MTP's tokens)
    for i in indices:
        names += layer_param_names(i, config)
    if lm_head_index(config.num_layers) in indices and mtp_index(config.num_layers) not in indices:
        names += layer_param_names(mtp_index(config.num_layers), config)  # held with the output head
    return names
