"""The GPT model's hyper-parameters (a dataclass; layers are handed what they need).

The defaults are GPT-2 as Megatron builds it. The architecture switches (Megatron-LM's flag names)
make the Llama / Mistral family: `normalization="RMSNorm"`, `position_embedding_type="rope"`,
`swiglu=True`, `num_query_groups < num_attention_heads` (grouped-query attention),
`untie_embeddings_and_output_weights=True`, `add_bias_linear=False`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ..moe.expert_counts import check_expert_counts
from .moe_layers import is_moe_block

RECOMPUTE_GRANULARITIES = ("full", "selective")
RECOMPUTE_METHODS = ("uniform", "block")
ATTENTION_BACKENDS = ("auto", "flash", "fused", "unfused")
NORMALIZATIONS = ("LayerNorm", "RMSNorm")
POSITION_EMBEDDING_TYPES = ("learned_absolute", "rope")
MOE_LOAD_BALANCING_TYPES = ("aux_loss", "seq_aux_loss", "none", "sinkhorn")


def default_ffn_hidden_size(hidden_size: int, swiglu: bool) -> int:
    """Megatron's default: 4h, or with SwiGLU 2/3 of that rounded down to a multiple of 64."""
    return int(4 * hidden_size * 2 / 3 / 64) * 64 if swiglu else 4 * hidden_size


@dataclass
class GPTConfig:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_attention_heads: int
    seq_length: int
    max_position_embeddings: int
    ffn_hidden_size: Optional[int] = None  # None -> default_ffn_hidden_size
    make_vocab_size_divisible_by: int = 128
    hidden_dropout: float = 0.1
    attention_dropout: float = 0.1
    layernorm_epsilon: float = 1e-5
    init_method_std: float = 0.02
    seed: int = 1234
    params_dtype: torch.dtype = torch.float32
    normalization: str = "LayerNorm"                 # or "RMSNorm" (weight only, no bias)
    apply_layernorm_1p: bool = False                 # norm weights stored zero-centred: the norm applies 1 + w
    position_embedding_type: str = "learned_absolute"  # or "rope" (no position-embedding table)
    rotary_base: int = 10000
    rotary_percent: float = 1.0                      # share of head_dim that RoPE rotates
    swiglu: bool = False                             # MLP out = W2 (silu(gate x) * (up x))
    num_query_groups: Optional[int] = None           # None -> num_attention_heads (no grouping)
    untie_embeddings_and_output_weights: bool = False
    add_bias_linear: bool = True
    add_qkv_bias: bool = False                       # a bias on the QKV projection even without add_bias_linear
    kv_channels: Optional[int] = None                # each head's dimension (None: hidden_size / num_attention_heads)
    qk_layernorm: bool = False                       # the model's norm over each head's q and k, before RoPE (Qwen3)
    # mixture of experts (Megatron-Core's names; megatron_zero/moe/): None -> every layer has a dense MLP
    num_experts: Optional[int] = None
    moe_layer_freq: object = 1                       # every N-th layer (offset, offset + N, ...) is an MoE layer, or a
    #                                                  tuple of 0 / 1 per layer (model/moe_layers.py)
    moe_layer_offset: int = 0                        # the first MoE block (Megatron-DeepSpeed's --expert-interval N: N-1)
    moe_ffn_hidden_size: Optional[int] = None        # None -> ffn_hidden_size
    moe_router_topk: int = 2
    moe_router_pre_softmax: bool = False             # softmax over all experts, then top-k (else top-k, softmax)
    moe_router_load_balancing_type: str = "aux_loss"
    moe_aux_loss_coeff: float = 0.0
    moe_z_loss_coeff: Optional[float] = None
    moe_grouped_gemm: bool = False                   # the local experts as one grouped GEMM (moe/grouped_mlp.py)
    moe_token_dispatcher_type: str = "alltoall"      # or "allgather" (moe/allgather_dispatch.py): the same result
    moe_router_score_function: str = "softmax"       # or "sigmoid" (moe/router.py)
    moe_router_topk_scaling_factor: Optional[float] = None  # router weights times this
    moe_router_dtype: Optional[str] = None           # "fp32": the router's GEMM in fp32 (None: the model dtype)
    # Megatron-Core's capacity (moe/token_dropping.py): None -> dropless
    moe_expert_capacity_factor: Optional[float] = None
    moe_token_drop_policy: str = "probs"              # or "position"
    moe_pad_expert_input_to_capacity: bool = False   # Megatron pads with zero-weight rows: the same results
    moe_shared_expert_intermediate_size: Optional[int] = None  # a shared expert of this width (moe/shared_expert.py)
    moe_shared_expert_gate: bool = False             # its output scaled by sigmoid(x g^T), g [1, h] (Qwen2-MoE)
    # DeepSpeed-MoE's capacity gating (moe/capacity_gating.py) where moe_capacity_factor is set; the aux
    # loss coefficient is then moe_aux_loss_coeff (Megatron-DeepSpeed's --moe-loss-coeff), k moe_router_topk
    moe_capacity_factor: Optional[float] = None      # training; None: Megatron-Core's dropless router
    moe_eval_capacity_factor: Optional[float] = None  # evaluation (None: the training factor)
    moe_min_capacity: int = 4
    moe_drop_tokens: bool = True                     # False: capacity is never exceeded, nothing dropped
    moe_use_rts: bool = True                         # top-1: random token selection past capacity
    moe_top2_2nd_expert_sampling: bool = True        # top-2: the second expert from Gumbel-noised logits
    # multi-token prediction (Megatron-Core's MTP, model/multi_token_prediction.py): None -> none
    mtp_num_layers: Optional[int] = None
    mtp_loss_scaling_factor: float = 0.1             # the depths' mean loss times this joins the LM loss's gradient
    # memory and speed (model/recompute.py, model/attention_core.py, sequence parallelism): none of
    # these changes a parameter, so checkpoints never record or need them
    recompute_granularity: Optional[str] = None  # None, 'full' or 'selective'
    recompute_method: Optional[str] = None       # 'uniform' or 'block' (full granularity)
    recompute_num_layers: int = 1
    moe_layer_recompute: bool = False            # each MoE layer runs again in backward (moe/layer.py)
    attention_backend: str = "auto"
    sequence_parallel: bool = False
    cp_comm_type: str = "p2p"  # context parallelism's K/V exchange (context_parallel/), when the model has a CP group

    def __post_init__(self):
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = default_ffn_hidden_size(self.hidden_size, self.swiglu)
        if self.num_query_groups is None:
            self.num_query_groups = self.num_attention_heads
        if self.moe_ffn_hidden_size is None:
            self.moe_ffn_hidden_size = self.ffn_hidden_size
        self._check_moe()
        self._check_mtp()
        if self.normalization not in NORMALIZATIONS:
            raise ValueError(f"normalization {self.normalization!r} is not one of {NORMALIZATIONS}")
        if self.position_embedding_type not in POSITION_EMBEDDING_TYPES:
            raise ValueError(f"position_embedding_type {self.position_embedding_type!r} is not one of "
                             f"{POSITION_EMBEDDING_TYPES}")
        if not 0 < self.rotary_percent <= 1:
            raise ValueError(f"rotary_percent {self.rotary_percent} must lie in (0, 1]")
        if self.num_query_groups < 1 or self.num_attention_heads % self.num_query_groups != 0:
            raise ValueError(f"num_attention_heads {self.num_attention_heads} is not divisible by "
                             f"num_query_groups {self.num_query_groups}")
        if self.hidden_size % self.num_attention_heads != 0:
            raise ValueError(f"hidden_size {self.hidden_size} is not divisible by "
                             f"num_attention_heads {self.num_attention_heads}")
        if self.seq_length > self.max_position_embeddings:
            raise ValueError(f"seq_length {self.seq_length} exceeds max_position_embeddings "
                             f"{self.max_position_embeddings}")
        for what, value, allowed in (("recompute_granularity", self.recompute_granularity, RECOMPUTE_GRANULARITIES),
                                     ("recompute_method", self.recompute_method, RECOMPUTE_METHODS),
                                     ("attention_backend", self.attention_backend, ATTENTION_BACKENDS)):
            if value is not None and value not in allowed:
                raise ValueError(f"{what} {value!r} is not one of {allowed}")
        if self.recompute_granularity == "full" and self.recompute_method is None:
            raise ValueError("recompute_granularity 'full' needs recompute_method 'uniform' or 'block'")
        if self.recompute_num_layers < 1:
            raise ValueError(f"recompute_num_layers {self.recompute_num_layers} must be at least 1")

        if self.position_embedding_type == "rope" and self.rotary_dim % 2 != 0:
            raise ValueError(f"rotary_percent {self.rotary_percent} of head_dim {self.head_dim} gives an odd "
                             f"rotary dimension {self.rotary_dim}; RoPE rotates pairs")

    def _check_moe(self) -> None:
        if self.num_experts is None:
            return
        check_expert_counts(self.num_experts, self.moe_router_topk)
        if isinstance(self.moe_layer_freq, (list, tuple)):
            self.moe_layer_freq = tuple(self.moe_layer_freq)
            if len(self.moe_layer_freq) != self.num_layers or set(self.moe_layer_freq) - {0, 1} or self.moe_layer_offset:
                raise ValueError(f"moe_layer_freq's pattern {list(self.moe_layer_freq)} must hold one 0 or 1 per layer "
                                 f"({self.num_layers}) and moe_layer_offset be 0")
        elif self.moe_layer_freq < 1 or not 0 <= self.moe_layer_offset < self.moe_layer_freq:
            raise ValueError(f"moe_layer_freq {self.moe_layer_freq} must be at least 1 and moe_layer_offset "
                             f"{self.moe_layer_offset} lie in 0..moe_layer_freq - 1")
        if self.moe_capacity_factor is not None:
            if self.moe_router_topk not in (1, 2):
                raise ValueError(f"capacity gating routes to 1 or 2 experts, not moe_router_topk {self.moe_router_topk}")
            if self.moe_eval_capacity_factor is None:
                self.moe_eval_capacity_factor = self.moe_capacity_factor
            if min(self.moe_capacity_factor, self.moe_eval_capacity_factor) <= 0 or self.moe_min_capacity < 0:
                raise ValueError("moe capacity factors must be positive and moe_min_capacity not negative")
        if self.moe_router_score_function not in ("softmax", "sigmoid"):
            raise ValueError(f"moe_router_score_function {self.moe_router_score_function!r} is not softmax or sigmoid")
        if self.moe_expert_capacity_factor is not None:
            if self.moe_capacity_factor is not None:
                raise ValueError("moe_expert_capacity_factor (Megatron-Core's capacity) and moe_capacity_factor "
                                 "(DeepSpeed-MoE's gating) are two routers' capacities; set one")
            if self.moe_expert_capacity_factor < 0 or self.moe_token_drop_policy not in ("probs", "position"):
                raise ValueError(f"moe_expert_capacity_factor {self.moe_expert_capacity_factor} must not be negative "
                                 f"and moe_token_drop_policy {self.moe_token_drop_policy!r} be probs or position")
        elif self.moe_pad_expert_input_to_capacity:
            raise ValueError("moe_pad_expert_input_to_capacity needs moe_expert_capacity_factor")
        shared = self.moe_shared_expert_intermediate_size
        if shared is not None and shared < 1:
            raise ValueError(f"moe_shared_expert_intermediate_size {shared} must be positive")
        if self.moe_shared_expert_gate and shared is None:
            raise ValueError("moe_shared_expert_gate gates the shared expert; set moe_shared_expert_intermediate_size")
        if self.moe_router_load_balancing_type not in MOE_LOAD_BALANCING_TYPES:
            raise ValueError(f"moe_router_load_balancing_type {self.moe_router_load_balancing_type!r} is not one "
                             f"of {MOE_LOAD_BALANCING_TYPES}")
        if self.moe_router_load_balancing_type == "sinkhorn" and self.moe_aux_loss_coeff > 0:
            raise ValueError("sinkhorn routing balances without an aux loss; set moe_aux_loss_coeff 0")
        if self.moe_token_dispatcher_type not in ("alltoall", "allgather"):
            raise ValueError(f"moe_token_dispatcher_type {self.moe_token_dispatcher_type!r} is not alltoall or allgather")

    def _check_mtp(self) -> None:
        if not self.mtp_num_layers:
            self.mtp_num_layers = None
            return
        if self.mtp_num_layers < 0:
            raise ValueError(f"mtp_num_layers {self.mtp_num_layers} must not be negative")
        if self.is_moe_layer(self.num_layers - 1):
            raise ValueError("an MTP layer takes the last block's structure, and an MoE one is not implemented here")

    def is_moe_layer(self, block: int) -> bool:
        """Whether transformer block `block` (0-based) has an MoE layer in place of its MLP (Megatron-Core's
        --moe-layer-freq N: blocks 0, N, 2N, ...; Megatron-DeepSpeed's --expert-interval N: N-1, 2N-1, ...)."""
        return self.num_experts is not None and is_moe_block(self.moe_layer_freq, self.moe_layer_offset, block)

    def shared_expert_mlp_in_size(self) -> int:
        """Rows of the shared expert's dense_h_to_4h: [gate; up] with SwiGLU."""
        return (2 if self.swiglu else 1) * self.moe_shared_expert_intermediate_size

    def moe_mlp_in_size(self) -> int:
        """Rows of an expert's dense_h_to_4h: [gate; up] with SwiGLU, else moe_ffn_hidden_size."""
        return 2 * self.moe_ffn_hidden_size if self.swiglu else self.moe_ffn_hidden_size

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def query_projection_size(self) -> int:
        """The attention's width between the heads and the output projection: heads x head_dim."""
        return self.num_attention_heads * self.head_dim

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.rotary_percent)

    @property
    def has_position_embeddings(self) -> bool:
        return self.position_embedding_type == "learned_absolute"

    @property
    def has_norm_bias(self) -> bool:
        return self.normalization == "LayerNorm"

    @property
    def qkv_size(self) -> int:
        """Rows of the fused QKV weight: per query group, its q heads, one k and one v head."""
        return (self.num_attention_heads + 2 * self.num_query_groups) * self.head_dim

    @property
    def mlp_in_size(self) -> int:
        """Rows of dense_h_to_4h: [gate; up] with SwiGLU, else ffn_hidden_size."""
        return 2 * self.ffn_hidden_size if self.swiglu else self.ffn_hidden_size

    def padded_vocab_size(self, tp: int = 1) -> int:
        """Vocabulary rounded up to a multiple of make_vocab_size_divisible_by * tp (Megatron's rule)."""
        multiple = self.make_vocab_size_divisible_by * tp
        return -(-self.vocab_size // multiple) * multiple

    def check_tp(self, tp: int, etp: Optional[int] = None) -> None:
        """Raise one clear sentence if this model cannot be split `tp` ways (its experts `etp` ways, default tp)."""
        sizes = [("num_attention_heads", self.num_attention_heads), ("ffn_hidden_size", self.ffn_hidden_size)]
        if self.num_experts is not None:
            if self.moe_ffn_hidden_size % (etp or tp) != 0:
                raise ValueError(f"moe_ffn_hidden_size {self.moe_ffn_hidden_size} is not divisible by the "
                                 f"expert-tensor-parallel size {etp or tp}")
            if self.moe_shared_expert_intermediate_size is not None:
                sizes.append(("moe_shared_expert_intermediate_size", self.moe_shared_expert_intermediate_size))
        for what, n in sizes:
            if n % tp != 0:
                raise ValueError(f"{what} {n} is not divisible by the tensor-parallel size {tp}")
        groups = self.num_query_groups
        if (groups % tp if groups >= tp else tp % groups) != 0:
            raise ValueError(f"num_query_groups {groups} and the tensor-parallel size {tp} must divide one another")
        if self.qkv_size % tp != 0:
            raise ValueError(f"the fused QKV size {self.qkv_size} is not divisible by the tensor-parallel size {tp}")
        if self.sequence_parallel and self.seq_length % tp != 0:
            raise ValueError(f"seq_length {self.seq_length} is not divisible by the tensor-parallel size {tp}, "
                             "which sequence parallelism splits it over")

