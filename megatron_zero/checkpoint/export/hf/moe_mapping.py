"""What the Hugging Face MoE architectures (mixtral.py, qwen2_moe.py) share: the router's semantics, the
MoE block's tensors, and the refusals of what our MoE layer cannot compute.

transformers 5.x computes with fused expert tensors (`experts.gate_up_proj` [E, 2I, h], `experts.down_proj`
[E, h, I]) but saves and loads the per-expert Linear names of the released checkpoints (its weight
conversion runs both ways), which are the names mapped here, one tensor per expert and matrix, as our
expert files hold them:

    ours (block i, expert e)                                      Hugging Face (block b = i - 2)
    mlp.deepspeed_moe.gate.wg.weight                [E, h]        <router>.weight
    ...deepspeed_experts.{e}.dense_h_to_4h.weight   [2I, h]       [gate (w1 / gate_proj); up (w3 / up_proj)]
    ...deepspeed_experts.{e}.dense_4h_to_h.weight   [h, I]        down (w2 / down_proj)

Routers: softmax over every expert, its top k, renormalised to sum 1 (Mixtral; Qwen2-MoE with
norm_topk_prob) is softmax over the top-k logits, our default (--moe-router-topk k); without the
renormalisation (Qwen2-MoE's default) it is --moe-router-pre-softmax. The aux loss is a training choice
(Hugging Face's differs from Megatron's by the factor k and sums over layers): an import sets none.
"""
from __future__ import annotations

from typing import List

from ....model.config import GPTConfig
from ....model.params import MOE_ROUTER_SUFFIX, expert_suffix
from .llama import mlp_mappings
from .mapping import TensorMapping, same


def moe_block_mappings(config: GPTConfig, ours: str, hf: str, router: str, experts: str, names) -> List[TensorMapping]:
    """Router and experts of an MoE block: `router` the HF router's weight name under `hf`, `experts` the
    prefix of expert e's MLP (formatted with e), `names` its (gate, up, down) Linear names."""
    out = [same(ours + MOE_ROUTER_SUFFIX, hf + router)]
    for e in range(config.num_experts):
        mine = ours + expert_suffix(e, "mlp.")
        out += mlp_mappings(mine, hf + experts.format(e), ("weight",), names)
    return out


def moe_flags(config: GPTConfig) -> List[str]:
    """The MoE flags of an imported model (Megatron-Core's names)."""
    out = ["--num-experts", str(config.num_experts), "--moe-router-topk", str(config.moe_router_topk),
           "--moe-ffn-hidden-size", str(config.moe_ffn_hidden_size)]
    if config.moe_layer_freq != 1:
        freq = config.moe_layer_freq
        out += ["--moe-layer-freq", str(list(freq) if isinstance(freq, tuple) else freq)]
    if config.moe_router_pre_softmax:
        out.append("--moe-router-pre-softmax")
    if config.moe_shared_expert_intermediate_size:
        out += ["--moe-shared-expert-intermediate-size", str(config.moe_shared_expert_intermediate_size)]
    if config.moe_shared_expert_gate:
        out.append("--moe-shared-expert-gate")
    return out


def dropless_topk(config: GPTConfig) -> bool:
    """Whether the model routes as Megatron-Core's dropless top-k router without extras (what both HF models do):
    softmax scores, no expert bias, groups or scaling factor (DeepSeek-V3's router, which these models lack)."""
    return (config.num_experts is not None and config.moe_capacity_factor is None
            and config.moe_layer_offset == 0 and not config.add_bias_linear
            and config.moe_router_score_function == "softmax" and not config.moe_router_enable_expert_bias
            and not config.moe_router_group_topk and not config.moe_router_topk_scaling_factor)
