"""Megatron-LM's FLOPs count of a Transformer, the reference that metrics/throughput.py's count is tested against.

`transformer_flops` is `num_floating_point_operations`'s inner `transformer_flops` of Megatron-LM's
megatron/training/training.py at tag core_v0.16.1 (commit 55ac708), copied unchanged but for three things: it takes
`args` and `batch_size` as arguments (there they are the enclosing function's), it sits at module level, and the
branch of the linear-attention variants (which needs Megatron-LM's imports and which our models have not) is left
out. Megatron-LM's `megatron/training` is not a package on PyPI (megatron-core ships only `megatron/core`).

    args = megatron_args(flags, padded_vocab_size)   # pretrain_gpt.py's flags as Megatron-LM parses them
    flops = transformer_flops(args, global_batch_size)

Copyright (c) 2019-2025, NVIDIA CORPORATION. All rights reserved. Redistribution and use in source and binary
forms, with or without modification, are permitted under the BSD 3-clause terms of Megatron-LM's LICENSE.
"""
from __future__ import annotations

import re
from types import SimpleNamespace

# the arguments transformer_flops reads: flag -> Megatron-LM's type (arguments.py); a switch is a bool
COUNTED = {"num-layers": int, "hidden-size": int, "num-attention-heads": int, "group-query-attention": bool,
           "num-query-groups": int, "kv-channels": int, "ffn-hidden-size": int, "swiglu": bool, "seq-length": int,
           "num-experts": int, "moe-layer-freq": "moe_freq_type", "moe-router-topk": int, "moe-ffn-hidden-size": int,
           "moe-shared-expert-intermediate-size": int, "mtp-num-layers": int, "multi-latent-attention": bool,
           "q-lora-rank": int, "kv-lora-rank": int, "qk-head-dim": int, "qk-pos-emb-head-dim": int,
           "v-head-dim": int}
DEFAULTS = dict(group_query_attention=False, num_query_groups=1, kv_channels=None, swiglu=False, num_experts=None,
                moe_layer_freq=1, moe_router_topk=2, moe_ffn_hidden_size=None,
                moe_shared_expert_intermediate_size=None, mtp_num_layers=None, multi_latent_attention=False,
                q_lora_rank=None, kv_lora_rank=32, qk_head_dim=128, qk_pos_emb_head_dim=64, v_head_dim=128,
                attention_output_gate=False)


def moe_freq_type(x):
    """Megatron-LM's --moe-layer-freq type (arguments.py's moe_freq_type and _eval_pattern)."""
    if isinstance(x, int):
        return x
    if "[" in x:
        if re.compile(r"[^,\d\[\]\(\)\+\*]").search(x):
            raise ValueError(f"Invalid pattern: {x}")
        return eval(x)  # what Megatron-LM does, after the check above
    return int(x)


def megatron_args(flags: dict, padded_vocab_size: int) -> SimpleNamespace:
    """Megatron-LM's args for transformer_flops from pretrain_gpt.py's flags ({"flag-name": value}; True a switch,
    None or False left out, testing/launch.py's flags_argv form): each counted flag parsed as its arguments.py
    types it, over its defaults, then kv_channels as its validate_args sets it; `padded_vocab_size` as its
    tokenizer pads the vocabulary."""
    args = dict(DEFAULTS)
    for flag, kind in COUNTED.items():
        value = flags.get(flag)
        if value is None or value is False:
            continue
        args[flag.replace("-", "_")] = True if kind is bool else moe_freq_type(str(value)) if kind == "moe_freq_type" \
            else kind(value)
    if args["kv_channels"] is None:
        args["kv_channels"] = args["hidden_size"] // args["num_attention_heads"]
    return SimpleNamespace(**args, padded_vocab_size=padded_vocab_size)


def transformer_flops(args, batch_size):
    """Calculate FLOPs for a standard Transformer model."""
    # TODO(helenn/dnarayanan): Refactor this to reuse the helper methods.
    # Group Query Attention.
    if not args.group_query_attention:
        args.num_query_groups = args.num_attention_heads
    # MoE.
    if args.num_experts is None:
        # Every Transformer MLP is dense.
        num_dense_layers = args.num_layers
        num_moe_layers = 0
        num_experts_routed_to = 0
        last_layer_is_moe = 0
    else:
        # Calculate number of dense and MoE Transformer MLPs.
        if isinstance(args.moe_layer_freq, int):
            moe_layer_pattern = [
                1 if (i % args.moe_layer_freq == 0) else 0 for i in range(args.num_layers)
            ]
        elif isinstance(args.moe_layer_freq, list):
            moe_layer_pattern = args.moe_layer_freq
        else:
            raise RuntimeError("Illegal --moe-layer-freq argument provided!")
        assert len(moe_layer_pattern) == args.num_layers, (
            f"Invalid length of moe_layer_pattern: {len(moe_layer_pattern)}, "
            f"expected {args.num_layers}, "
            f"current moe layer pattern: {args.moe_layer_freq}"
        )
        num_moe_layers = sum(moe_layer_pattern)  # Number of 1s in `moe_layer_pattern`.
        num_dense_layers = args.num_layers - num_moe_layers
        num_experts_routed_to = args.moe_router_topk
        last_layer_is_moe = moe_layer_pattern[-1]

    if args.mtp_num_layers is not None:
        mtp_num_layers = args.mtp_num_layers
        num_moe_layers += last_layer_is_moe * mtp_num_layers
        num_dense_layers += (1 - last_layer_is_moe) * mtp_num_layers
        num_layers = args.num_layers + mtp_num_layers
    else:
        mtp_num_layers = 0
        num_layers = args.num_layers

    moe_ffn_hidden_size = (
        args.moe_ffn_hidden_size
        if args.moe_ffn_hidden_size is not None
        else args.ffn_hidden_size
    )
    shared_expert_ffn_hidden_size = (
        0
        if args.moe_shared_expert_intermediate_size is None
        else args.moe_shared_expert_intermediate_size
    )

    # - 3x: Each GEMM in the model needs to be performed 3 times (forward pass,
    #       backward wgrad [weight gradient], backward dgrad [data gradient]).
    forward_backward_expansion_factor = 3
    # - 2x: A GEMM of a m*n tensor with a n*k tensor requires 2mnk floating-point operations.
    fma_expansion_factor = 2
    # - 3x (SwiGLU enabled): h->2*ffn_h GEMM and ffn_h->h GEMM are stacked.
    # - 2x (SwiGLU disabled): h->ffn_h GEMM and ffn_h->h GEMM are stacked.
    ffn_expansion_factor = 3 if args.swiglu else 2

    if args.multi_latent_attention:
        assert not args.group_query_attention
        '''
        Basic arithmetic
        let B is batch size, s is seq_len, h is embedding dim,
        for one self_attnetion block (prenorm is not included)
        qkv projection:  6Bsh^2
        attn:            2Bs^2h
        attn over value: 2Bs^2h
        oproj:           2Bsh^2

        references
        https://arxiv.org/abs/2305.10403
        https://arxiv.org/abs/2205.05198
        '''
        ## MLA
        if args.q_lora_rank is None:
            q_term = (
                args.hidden_size
                * args.num_attention_heads
                * (args.qk_head_dim + args.qk_pos_emb_head_dim)
            )
        else:
            q_term = args.q_lora_rank * (
                args.hidden_size
                + args.num_attention_heads * (args.qk_head_dim + args.qk_pos_emb_head_dim)
                + 1
            )
        standard_self_attn_term = (
            forward_backward_expansion_factor
            * fma_expansion_factor
            * (
                ## q lora + rope + q norm
                q_term
                ## kv lora + rope + kv norm
                + args.kv_lora_rank
                * (
                    args.hidden_size
                    + args.num_attention_heads * (args.qk_head_dim + args.v_head_dim)
                    + 1
                )
                + args.hidden_size * args.qk_pos_emb_head_dim
                ## o proj
                + (args.num_attention_heads * args.v_head_dim) * args.hidden_size
                ## core attn
                + args.seq_length
                * (args.num_attention_heads * (args.qk_head_dim + args.qk_pos_emb_head_dim))
                / 2  # causal mask (only half of the mask is non-zero)
                + args.seq_length * args.num_attention_heads * args.v_head_dim / 2
            )
        )

    else:
        ## MHA or GQA
        query_projection_size = args.kv_channels * args.num_attention_heads
        key_projection_size = args.kv_channels * args.num_query_groups
        value_projection_size = args.kv_channels * args.num_query_groups
        gate_projection_size = query_projection_size if args.attention_output_gate else 0
        standard_self_attn_term = (
            forward_backward_expansion_factor
            * fma_expansion_factor
            * (
                ## qkv proj
                args.hidden_size
                * (
                    query_projection_size
                    + key_projection_size
                    + value_projection_size
                    + gate_projection_size
                )
                ## core attention
                + query_projection_size
                * args.seq_length
                / 2  # causal mask (only half of the mask is non-zero)
                * 2  # QK^T and (QK^T)V
                ## out proj
                + query_projection_size
                * args.hidden_size
            )
        )

    # (the linear-attention variants' branch, which this model has not, left out)
    num_linear_attention_layers = 0
    linear_self_attn_term = 0
    num_standard_attention_layers = num_layers

    self_attn_term = (
        linear_self_attn_term * num_linear_attention_layers
        + standard_self_attn_term * num_standard_attention_layers
    )

    total_floating_point_operations = (
        batch_size
        * args.seq_length
        * (
            # MLP
            forward_backward_expansion_factor
            * fma_expansion_factor
            * args.hidden_size
            * (
                # dense layer (deepseek v2, v3 style)
                (args.ffn_hidden_size * ffn_expansion_factor)
                * num_dense_layers
                # routed experts
                + (moe_ffn_hidden_size * num_experts_routed_to * ffn_expansion_factor)
                * num_moe_layers
                # Shared Experts.
                + (shared_expert_ffn_hidden_size * ffn_expansion_factor)
                * num_moe_layers
            )
            # Self Attention
            + self_attn_term
            # MTP norms and proj
            + forward_backward_expansion_factor
            * fma_expansion_factor
            * mtp_num_layers
            * (
                # MTP eh norm + final nrom
                3 * args.hidden_size
                # MTH eh proj
                + 2 * args.hidden_size * args.hidden_size
            )
            # Logit.
            + forward_backward_expansion_factor
            * fma_expansion_factor
            * args.hidden_size
            * args.padded_vocab_size
            * (mtp_num_layers + 1)  # MTP + final logit
        )
    )
    return total_floating_point_operations
