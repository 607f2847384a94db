"""DeepseekV3ForCausalLM <-> our GPT with multi-latent attention (model/mla.py), DeepSeek-V3's router (sigmoid
scores, the expert bias, group-limited top-k: moe/router.py, moe/expert_bias.py), a shared expert and dense first
blocks.

    Hugging Face (block b)                                   ours (block b's index)
    self_attn.q_a_proj.weight [q_lora_rank, h]               self_attention.linear_q_down_proj.weight
    self_attn.q_a_layernorm.weight                           self_attention.q_layernorm.weight (--qk-layernorm)
    self_attn.q_b_proj.weight [heads (nope + rope), q_lora]  self_attention.linear_q_up_proj.weight
    self_attn.q_proj.weight (q_lora_rank null)               self_attention.linear_q_proj.weight
    self_attn.kv_a_proj_with_mqa.weight [kv_lora + rope, h]  self_attention.linear_kv_down_proj.weight
    self_attn.kv_a_layernorm.weight                          self_attention.kv_layernorm.weight
    self_attn.kv_b_proj.weight [heads (nope + v), kv_lora]   self_attention.linear_kv_up_proj.weight
    self_attn.o_proj.weight                                  self_attention.dense.weight
    mlp.gate.weight [E, h]                                   mlp.deepspeed_moe.gate.wg.weight
    mlp.gate.e_score_correction_bias [E] (a buffer)          mlp.deepspeed_moe.gate.expert_bias (a buffer; zeros
                                                             written for a router without one)
    mlp.experts.{e}.{gate,up,down}_proj.weight               the expert's dense_h_to_4h [gate; up], dense_4h_to_h
    mlp.shared_experts.{gate,up,down}_proj.weight            mlp.shared_expert.* (width n_shared_experts x moe)
    a dense block's mlp.{gate,up,down}_proj.weight           mlp.* (the first first_k_dense_replace blocks)

Every tensor is the same on both sides: both lay q's rows out per head as [nope; rope], kv_b's as [nope; v] and
kv_a's as [latent; rope], and both rotate the rope part in DeepSeek's interleaved pairs (HF's rope_interleave
true, every released model; ours always), so nothing is permuted. The config's names and ours:

    qk_nope_head_dim, qk_rope_head_dim, v_head_dim      --qk-head-dim, --qk-pos-emb-head-dim, --v-head-dim
    q_lora_rank, kv_lora_rank                           --q-lora-rank (none when null), --kv-lora-rank
    rope_scaling / rope_parameters of type yarn:        --rope-type yarn, --rotary-scaling-factor,
      factor, original_max_position_embeddings,          --original-max-position-embeddings,
      beta_fast, beta_slow, mscale, mscale_all_dim        --beta-fast, --beta-slow, --mscale, --mscale-all-dim
    n_routed_experts, num_experts_per_tok               --num-experts, --moe-router-topk
    moe_intermediate_size, n_shared_experts             --moe-ffn-hidden-size, --moe-shared-expert-intermediate-size
    e_score_correction_bias, sigmoid scores             --moe-router-enable-expert-bias, --moe-router-score-function sigmoid
    n_group, topk_group                                 --moe-router-num-groups, --moe-router-group-topk
    routed_scaling_factor                               --moe-router-topk-scaling-factor
    first_k_dense_replace k                             --moe-layer-freq "[0]*k+[1]*(layers-k)"

What differs in meaning is refused (`unsupported_export` names it for an export; config_from_hf for an import):
HF scores a group by the sum of its top 2 experts, Megatron-Core by its top k / group-topk (equal where that is 2,
as DeepSeek-V3's 8 / 4); HF's latent norms use epsilon 1e-6 whatever rms_norm_eps says, ours the model's;
HF's sigmoid router renormalises the top-k weights only with norm_topk_prob, Megatron-Core's always for k > 1.

Multi-token prediction: DeepSeek's files hold depth k as the block after the last, model.layers.{L + k}
(DeepSeek-V3's model.layers.61; transformers' class computes no MTP and its loader skips them), our
--mtp-num-layers depth k (model/multi_token_prediction.py, laid out as Megatron-Core's and as vLLM reads
DeepSeek's: eh_proj over [enorm(embedding); hnorm(hidden)]):

    model.layers.{L+k}.enorm / hnorm / eh_proj.weight        {mtp}.{k}.enorm / hnorm / eh_proj.weight
    model.layers.{L+k}.<the block's tensors>                  {mtp}.{k}.transformer_layer.<the last block's>
    model.layers.{L+k}.shared_head.norm.weight                {mtp}.{k}.final_layernorm.weight
    model.layers.{L+k}.embed_tokens / shared_head.head        copies of the embedding and output layer: written
                                                             by an export, and on import equal to them or refused

An import takes the depths the files hold (`config_for_files`; transformers' save_pretrained writes none, and
config_from_hf alone describes transformers' model, without them); an export writes ours and sets
num_nextn_predict_layers to their number.
"""
from __future__ import annotations

import dataclasses
import math
from typing import List, Optional

import torch

from ....model.config import GPTConfig
from ....model.layer_indices import mtp_index
from ....model.moe_layers import as_pattern, placement
from ....model.params import MTP_LAYER_PREFIX, MTP_PROJECTION, lm_head_name, word_embeddings_name
from ....ops.yarn import concentration_factor, yarn_mscale
from ...errors import CheckpointError
from . import llama
from .mapping import TensorMapping, base_flags, same
from .moe_mapping import moe_block_mappings

HF_ARCHITECTURE = "DeepseekV3ForCausalLM"
MODEL_TYPE = "deepseek_v3"
SKIPPED_HF = llama.SKIPPED_HF
PRESERVED_HF = ()
FP32_HF = (r"\.e_score_correction_bias$",)  # transformers keeps it fp32 (_keep_in_fp32_modules_strict); so does an export
LATENT_NORM_EPS = 1e-6  # HF's q_a_layernorm and kv_a_layernorm: DeepseekV3RMSNorm's default, never rms_norm_eps
EXPERT_BIAS_SUFFIX = "mlp.deepspeed_moe.gate.expert_bias"


def _hf_attention_factor(factor: float, mscale, mscale_all_dim) -> float:
    """transformers' YaRN factor on cos and sin when the config gives no attention_factor."""
    if mscale and mscale_all_dim:
        return yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
    return yarn_mscale(factor)


def _rope(hf: dict, refuse) -> dict:
    """Our rotary fields from the config's rope_scaling (DeepSeek's release) or rope_parameters (transformers 5)."""
    params = {**(hf.get("rope_scaling") or {}), **(hf.get("rope_parameters") or {})}
    kind = params.get("rope_type", params.get("type", "default"))
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    theta = int(theta) if float(theta).is_integer() else float(theta)
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        refuse(f"partial_rotary_factor {params['partial_rotary_factor']} (our MLA rotates its whole rope part)")
    if kind == "default":
        return dict(rope_type="rope", rotary_base=theta)
    if kind != "yarn":
        refuse(f"rope scaling of type {kind!r} (supported: yarn, or none)")
    if params.get("truncate", True) is False:
        refuse("YaRN with truncate false (ours rounds the ramp's ends to whole dimensions)")
    positions = hf.get("max_position_embeddings", 4096)
    original = int(hf.get("original_max_position_embeddings") or params.get("original_max_position_embeddings")
                   or positions)
    factor = float(params.get("factor") or positions / original)
    mscale, all_dim = params.get("mscale"), params.get("mscale_all_dim")
    ours = dict(mscale=float(mscale) if mscale and all_dim else 1.0, mscale_all_dim=float(all_dim or 0.0))
    theirs = params.get("attention_factor")
    theirs = _hf_attention_factor(factor, mscale, all_dim) if theirs is None else float(theirs)
    if not math.isclose(concentration_factor(factor, **ours), theirs, rel_tol=1e-12):
        refuse(f"a YaRN attention factor of {theirs} (mscale {mscale}, mscale_all_dim {all_dim}), which "
               "--mscale / --mscale-all-dim do not give together with that softmax scale")
    return dict(rope_type="yarn", rotary_base=theta, rotary_scaling_factor=factor,
                original_max_position_embeddings=original, beta_fast=float(params.get("beta_fast") or 32),
                beta_slow=float(params.get("beta_slow") or 1), **ours)


def _router(hf: dict, layers: int, refuse) -> dict:
    """Our MoE fields, or none for a model whose every block is dense (first_k_dense_replace >= layers)."""
    dense = int(hf.get("first_k_dense_replace", 3) or 0)
    if dense >= layers:
        return {}
    experts = int(hf.get("n_routed_experts") or hf.get("num_local_experts") or 256)
    topk, norm = int(hf.get("num_experts_per_tok") or 8), bool(hf.get("norm_topk_prob", True))
    if topk > 1 and not norm:
        refuse(f"norm_topk_prob false with num_experts_per_tok {topk} (Megatron-Core's sigmoid router renormalises "
               "the top-k weights)")
    if topk == 1 and norm:
        refuse("norm_topk_prob true with num_experts_per_tok 1 (a weight of 1; Megatron-Core's sigmoid router "
               "keeps the score)")
    groups, group_topk = int(hf.get("n_group") or 1), int(hf.get("topk_group") or 1)
    shared = int(hf.get("n_shared_experts") or 0)
    if shared < 1:
        refuse(f"n_shared_experts {shared} (its MoE layers always add a shared expert of that many widths)")
    out = {}
    if group_topk < groups:
        if topk // group_topk != 2:
            refuse(f"n_group {groups}, topk_group {group_topk} and num_experts_per_tok {topk}: it scores a group by "
                   f"its top 2 experts, --moe-router-group-topk by its top {topk} / {group_topk}")
        out = dict(moe_router_num_groups=groups, moe_router_group_topk=group_topk)
    freq, offset = placement([0] * dense + [1] * (layers - dense), layers)
    scaling = float(hf.get("routed_scaling_factor") or 1.0)
    moe = int(hf.get("moe_intermediate_size") or 2048)
    return dict(out, num_experts=experts, moe_router_topk=topk, moe_ffn_hidden_size=moe, moe_layer_freq=freq,
                moe_layer_offset=offset, moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                moe_router_dtype="fp32", moe_router_topk_scaling_factor=None if scaling == 1.0 else scaling,
                moe_shared_expert_intermediate_size=moe * shared)


def config_for_files(config: GPTConfig, hf: dict, names) -> GPTConfig:
    """`config` (config_from_hf's: transformers' model, no MTP) with the multi-token prediction depths the HF files
    hold, their eh_proj present, up to config.json's num_nextn_predict_layers."""
    depths, most = 0, int(hf.get("num_nextn_predict_layers") or 0)
    while depths < most and f"model.layers.{config.num_layers + depths}.{MTP_PROJECTION}" in names:
        depths += 1
    return dataclasses.replace(config, mtp_num_layers=depths or None)


def config_from_hf(hf: dict) -> GPTConfig:
    def refuse(feature):
        raise CheckpointError(f"this DeepSeek-V3 config has {feature}, which our GPT does not implement")

    if hf.get("hidden_act", "silu") != "silu":
        refuse(f"hidden_act {hf['hidden_act']!r} (supported: silu)")
    if hf.get("attention_bias"):
        refuse("attention_bias true (biases on the latent projections, which our MLA does not have)")
    heads = hf.get("num_attention_heads", 128)
    if (hf.get("num_key_value_heads") or heads) != heads:
        refuse(f"num_key_value_heads {hf['num_key_value_heads']} other than num_attention_heads {heads}")
    if hf.get("rope_interleave", True) is False:
        refuse("rope_interleave false (the rope part rotated in halves; our MLA takes DeepSeek's interleaved pairs)")
    eps = float(hf.get("rms_norm_eps", 1e-6))
    if eps != LATENT_NORM_EPS:
        refuse(f"rms_norm_eps {eps} while its latent norms use {LATENT_NORM_EPS} (ours use the model's epsilon)")
    layers, positions = hf.get("num_hidden_layers", 61), hf.get("max_position_embeddings", 4096)
    q_lora = hf.get("q_lora_rank", 1536)
    return GPTConfig(vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"], num_layers=layers,
                     num_attention_heads=heads, seq_length=positions, max_position_embeddings=positions,
                     ffn_hidden_size=hf.get("intermediate_size", 18432), layernorm_epsilon=eps, hidden_dropout=0.0,
                     attention_dropout=float(hf.get("attention_dropout") or 0.0),
                     init_method_std=hf.get("initializer_range", 0.02), normalization="RMSNorm",
                     position_embedding_type="rope", swiglu=True, add_bias_linear=False,
                     untie_embeddings_and_output_weights=not hf.get("tie_word_embeddings", False), qk_layernorm=True,
                     multi_latent_attention=True, q_lora_rank=None if q_lora is None else int(q_lora),
                     kv_lora_rank=int(hf.get("kv_lora_rank", 512)), qk_head_dim=int(hf.get("qk_nope_head_dim", 128)),
                     qk_pos_emb_head_dim=int(hf.get("qk_rope_head_dim", 64)), v_head_dim=int(hf.get("v_head_dim", 128)),
                     **_rope(hf, refuse), **_router(hf, layers, refuse))


def _dense_blocks(config: GPTConfig) -> Optional[int]:
    """first_k_dense_replace of the model: its MoE blocks are all those after the first k (None: not so placed)."""
    if config.num_experts is None:
        return config.num_layers
    pattern = as_pattern(config.moe_layer_freq, config.moe_layer_offset, config.num_layers)
    k = pattern.index(1)
    return k if pattern == [0] * k + [1] * (config.num_layers - k) else None


def _limits_groups(config: GPTConfig) -> bool:
    """Whether group-limited routing leaves some groups out (a token choosing from every group is plain top-k)."""
    return bool(config.moe_router_group_topk) and config.moe_router_group_topk < config.moe_router_num_groups


def unsupported_export(config: GPTConfig) -> Optional[str]:
    """What of an MLA model DeepseekV3ForCausalLM cannot hold, in a few words (None: it holds the model)."""
    c = config
    if not c.qk_layernorm:
        return "no latent norms (HF's always norms the q and kv latents; train with --qk-layernorm)"
    checks = ((c.normalization != "RMSNorm" or not c.swiglu, "LayerNorm or a non-SwiGLU MLP (RMSNorm and SwiGLU)"),
              (c.add_bias_linear or c.add_qkv_bias, "linear biases (none)"),
              (c.has_position_embeddings, "learned position embeddings (RoPE only)"),
              (c.layernorm_epsilon != LATENT_NORM_EPS,
               f"norm epsilon {c.layernorm_epsilon} (HF's latent norms use {LATENT_NORM_EPS})"),
              (c.rope_type == "rope" and c.rotary_percent != 1.0, f"rotary percent {c.rotary_percent} (1.0)"))
    for wrong, what in checks:
        if wrong:
            return what
    if c.num_experts is None:
        return None
    if _dense_blocks(c) is None:
        return (f"MoE blocks at {as_pattern(c.moe_layer_freq, c.moe_layer_offset, c.num_layers)} (HF's are all blocks "
                "after the first k dense ones)")
    shared = c.moe_shared_expert_intermediate_size or 0
    checks = ((c.moe_router_score_function != "sigmoid", "softmax routing (sigmoid scores)"),
              (c.moe_capacity_factor is not None or c.moe_expert_capacity_factor is not None,
               "an expert capacity (dropless routing)"),
              (_limits_groups(c) and c.moe_router_topk // c.moe_router_group_topk != 2,
               f"--moe-router-topk {c.moe_router_topk} over --moe-router-group-topk {c.moe_router_group_topk} groups "
               "(HF scores a group by its top 2 experts: topk / group-topk 2)"),
              (not shared or shared % c.moe_ffn_hidden_size or c.moe_shared_expert_gate,
               "no ungated shared expert a multiple of --moe-ffn-hidden-size wide"))
    return next((what for wrong, what in checks if wrong), None)


def matches(config: GPTConfig) -> bool:
    return config.multi_latent_attention and unsupported_export(config) is None


def flags(config: GPTConfig) -> List[str]:
    c = config
    out = base_flags(c) + ["--normalization", "RMSNorm", "--position-embedding-type", "rope", "--rotary-base",
                           str(c.rotary_base), "--swiglu", "--disable-bias-linear", "--multi-latent-attention",
                           "--qk-layernorm", "--kv-lora-rank", str(c.kv_lora_rank), "--qk-head-dim",
                           str(c.qk_head_dim), "--qk-pos-emb-head-dim", str(c.qk_pos_emb_head_dim), "--v-head-dim",
                           str(c.v_head_dim), "--rope-type", c.rope_type]
    if c.q_lora_rank is not None:
        out += ["--q-lora-rank", str(c.q_lora_rank)]
    if c.rope_type == "yarn":
        out += ["--rotary-scaling-factor", repr(c.rotary_scaling_factor), "--original-max-position-embeddings",
                str(c.original_max_position_embeddings), "--beta-fast", repr(c.beta_fast), "--beta-slow",
                repr(c.beta_slow), "--mscale", repr(c.mscale), "--mscale-all-dim", repr(c.mscale_all_dim)]
    if c.untie_embeddings_and_output_weights:
        out.append("--untie-embeddings-and-output-weights")
    if c.mtp_num_layers:
        out += ["--mtp-num-layers", str(c.mtp_num_layers)]
    if c.num_experts is None:
        return out
    dense = _dense_blocks(c)
    out += ["--num-experts", str(c.num_experts), "--moe-router-topk", str(c.moe_router_topk), "--moe-ffn-hidden-size",
            str(c.moe_ffn_hidden_size), "--moe-shared-expert-intermediate-size",
            str(c.moe_shared_expert_intermediate_size), "--moe-router-score-function", "sigmoid",
            "--moe-router-enable-expert-bias", "--moe-router-dtype", "fp32"]
    if dense:
        out += ["--moe-layer-freq", f"[0]*{dense}+[1]*{c.num_layers - dense}"]
    if _limits_groups(c):
        out += ["--moe-router-num-groups", str(c.moe_router_num_groups), "--moe-router-group-topk",
                str(c.moe_router_group_topk)]
    if c.moe_router_topk_scaling_factor:
        out += ["--moe-router-topk-scaling-factor", repr(c.moe_router_topk_scaling_factor)]
    return out


def hf_config(config: GPTConfig) -> dict:
    c = config
    out = {"architectures": [HF_ARCHITECTURE], "model_type": MODEL_TYPE, "vocab_size": c.vocab_size,
           "hidden_size": c.hidden_size, "intermediate_size": c.ffn_hidden_size, "num_hidden_layers": c.num_layers,
           "num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.num_attention_heads,
           "q_lora_rank": c.q_lora_rank, "kv_lora_rank": c.kv_lora_rank, "qk_nope_head_dim": c.qk_head_dim,
           "qk_rope_head_dim": c.qk_pos_emb_head_dim, "v_head_dim": c.v_head_dim, "hidden_act": "silu",
           "max_position_embeddings": c.max_position_embeddings, "initializer_range": c.init_method_std,
           "rms_norm_eps": c.layernorm_epsilon, "rope_theta": float(c.rotary_base), "rope_interleave": True,
           "attention_bias": False, "attention_dropout": 0.0, "tie_word_embeddings": not c.untie_embeddings_and_output_weights,
           "first_k_dense_replace": _dense_blocks(c), "num_nextn_predict_layers": c.mtp_num_layers or 0}
    if c.rope_type == "yarn":
        rope = {"type": "yarn", "rope_type": "yarn", "factor": c.rotary_scaling_factor,
                "original_max_position_embeddings": c.original_max_position_embeddings, "beta_fast": c.beta_fast,
                "beta_slow": c.beta_slow, "mscale": c.mscale, "mscale_all_dim": c.mscale_all_dim}
        ours = concentration_factor(c.rotary_scaling_factor, c.mscale, c.mscale_all_dim)
        if not math.isclose(ours, _hf_attention_factor(c.rotary_scaling_factor, c.mscale, c.mscale_all_dim),
                            rel_tol=1e-12):
            rope["attention_factor"] = ours  # HF ignores mscale without mscale_all_dim; say the factor itself
        out["rope_scaling"] = rope
    if c.num_experts is None:  # every block dense: the MoE fields are HF's defaults, unused
        return out
    return {**out, "n_routed_experts": c.num_experts, "num_experts_per_tok": c.moe_router_topk,
            "moe_intermediate_size": c.moe_ffn_hidden_size,
            "n_shared_experts": c.moe_shared_expert_intermediate_size // c.moe_ffn_hidden_size,
            "n_group": c.moe_router_num_groups if _limits_groups(c) else 1,
            "topk_group": c.moe_router_group_topk if _limits_groups(c) else 1, "norm_topk_prob": c.moe_router_topk > 1,
            "routed_scaling_factor": c.moe_router_topk_scaling_factor or 1.0, "output_router_logits": False}


def _attention(config: GPTConfig, ours: str, hf: str) -> List[TensorMapping]:
    a, s = ours + "self_attention.", hf + "self_attn."
    if config.q_lora_rank is None:
        out = [same(a + "linear_q_proj.weight", s + "q_proj.weight")]
    else:
        out = [same(a + "linear_q_down_proj.weight", s + "q_a_proj.weight"),
               same(a + "linear_q_up_proj.weight", s + "q_b_proj.weight"),
               same(a + "q_layernorm.weight", s + "q_a_layernorm.weight")]
    return out + [same(a + "linear_kv_down_proj.weight", s + "kv_a_proj_with_mqa.weight"),
                  same(a + "linear_kv_up_proj.weight", s + "kv_b_proj.weight"),
                  same(a + "kv_layernorm.weight", s + "kv_a_layernorm.weight"),
                  same(a + "dense.weight", s + "o_proj.weight")]


def _mlp(config: GPTConfig, block: int, ours: str, hf: str) -> List[TensorMapping]:
    if not config.is_moe_layer(block):
        return llama.dense_block_mlp(config, block, ours, hf)
    out = moe_block_mappings(config, ours, hf, "mlp.gate.weight", "mlp.experts.{}.",
                             ("gate_proj", "up_proj", "down_proj"))
    out += llama.mlp_mappings(ours + "mlp.shared_expert.", hf + "mlp.shared_experts.", ("weight",))
    bias = hf + "mlp.gate.e_score_correction_bias"
    if config.moe_router_enable_expert_bias:
        return out + [same(ours + EXPERT_BIAS_SUFFIX, bias)]  # a buffer, not a parameter
    router = out[0]  # no bias of ours: HF's router always adds one, and zeros route as ours (an export only)
    zeros = TensorMapping(router.ours, router.hf + (bias,), lambda ts: ts[0],
                          lambda t: [t, torch.zeros(config.num_experts, dtype=torch.float32)])
    return [zeros] + out[1:]


def _copied(m: TensorMapping, copies: List[str]) -> TensorMapping:
    """`m` with the MTP layers' copies of its tensor: written by an export; on import equal to it or refused."""
    def to_ours(ts):
        for name, t in zip(copies, ts[len(m.hf):]):
            if not torch.equal(t, ts[0]):
                raise CheckpointError(f"{name} differs from {m.hf[0]}: our multi-token prediction shares the "
                                      "model's embedding and output layer")
        return m.to_ours(ts[:len(m.hf)])

    def to_hf(t):
        hf = m.to_hf(t)
        return hf + [hf[0]] * len(copies)
    return TensorMapping(m.ours, m.hf + tuple(copies), to_ours, to_hf)


def _mtp_depth(config: GPTConfig, k: int) -> List[TensorMapping]:
    """Depth k's mappings: its norms and projection, its block (built as the last one), its final norm."""
    ours, hf = f"{mtp_index(config.num_layers)}.{k}.", f"model.layers.{config.num_layers + k}."
    block = ours + MTP_LAYER_PREFIX
    out = [same(ours + name, hf + name) for name in ("enorm.weight", "hnorm.weight", MTP_PROJECTION)]
    out.append(same(block + "input_layernorm.weight", hf + "input_layernorm.weight"))
    out += _attention(config, block, hf)
    out.append(same(block + "post_attention_layernorm.weight", hf + "post_attention_layernorm.weight"))
    out += _mlp(config, config.num_layers - 1, block, hf)
    return out + [same(ours + "final_layernorm.weight", hf + "shared_head.norm.weight")]


def tensor_mappings(config: GPTConfig) -> List[TensorMapping]:
    out = llama.tensor_mappings(config, _mlp, _attention)
    depths = range(config.mtp_num_layers or 0)
    if not depths:
        return out
    layers = [f"model.layers.{config.num_layers + k}." for k in depths]
    embedding, head = word_embeddings_name(config), lm_head_name(config)
    tied = not config.untie_embeddings_and_output_weights
    for i, m in enumerate(out):
        if m.ours == embedding:  # tied: the one tensor is also each depth's shared_head.head
            copies = [h + "embed_tokens.weight" for h in layers] + (
                [h + "shared_head.head.weight" for h in layers] if tied else [])
            out[i] = _copied(m, copies)
        elif m.ours == head and not tied:
            out[i] = _copied(m, [h + "shared_head.head.weight" for h in layers])
    return out + [m for k in depths for m in _mtp_depth(config, k)]
