"""The GPT model's hyper-parameters (a dataclass; layers are handed what they need).

The defaults are GPT-2 as Megatron builds it. The architecture switches (Megatron-LM's flag names)
make the Llama / Mistral family: `normalization="RMSNorm"`, `position_embedding_type="rope"`,
`swiglu=True`, `num_query_groups < num_attention_heads` (grouped-query attention),
`untie_embeddings_and_output_weights=True`, `add_bias_linear=False`.

The defaults below are the model flags' too (config/model.py and config/moe.py read them from here), and the
shape rules GPTConfig checks are the flags' (shape_rules.py), so a model the command line accepts is one this
accepts.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from . import shape_rules
from .moe_layers import is_moe_block

if TYPE_CHECKING:
    import torch

RECOMPUTE_GRANULARITIES = ("full", "selective")
RECOMPUTE_METHODS = ("uniform", "block")
ATTENTION_BACKENDS = ("auto", "flash", "fused", "unfused")
NORMALIZATIONS = ("LayerNorm", "RMSNorm")
POSITION_EMBEDDING_TYPES = ("learned_absolute", "rope")
ROPE_TYPES = ("rope", "yarn")
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
    params_dtype: Optional[torch.dtype] = None  # None: torch.float32 (torch loads when a config is made)
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
    qk_layernorm: bool = False                       # the model's norm over each head's q and k, before RoPE (Qwen3);
    #                                                  with MLA the norms of the q and kv latents (Megatron-Core's)
    # multi-latent attention (DeepSeek-V2/V3; model/mla.py), Megatron-Core's MLATransformerConfig names
    multi_latent_attention: bool = False
    q_lora_rank: Optional[int] = None                # None: q projected directly, without a latent
    kv_lora_rank: int = 32
    qk_head_dim: int = 128                           # each head's q and k without position (q_head_dim adds pos)
    qk_pos_emb_head_dim: int = 64                    # the rotary part of q and k (one k part shared by the heads)
    v_head_dim: int = 128
    rope_type: str = "rope"                          # MLA's rotary tables: rope or yarn (ops/yarn.py)
    rotary_scaling_factor: float = 1.0               # YaRN's context extension factor (and the softmax's mscale)
    original_max_position_embeddings: int = 4096     # YaRN: the context the model was first trained at
    beta_fast: float = 32.0                          # YaRN's ramp: dimensions turning more often keep their frequency
    beta_slow: float = 1.0                           # ... fewer: interpolated by the scaling factor
    mscale: float = 1.0                              # YaRN's concentration factor on cos and sin
    mscale_all_dim: float = 0.0                      # ... divided by this one's, whose square scales the softmax
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
    moe_router_enable_expert_bias: bool = False      # the aux-loss-free expert bias (moe/expert_bias.py)
    moe_router_bias_update_rate: float = 1e-3        # its step per global batch
    moe_router_num_groups: Optional[int] = None      # group-limited routing: groups of experts (moe/router.py)
    moe_router_group_topk: Optional[int] = None      # groups each token's experts come from
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
        if self.params_dtype is None:
            import torch

            self.params_dtype = torch.float32
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
        shape_rules.rotary_percent_range(self.rotary_percent)
        shape_rules.query_groups(self.num_attention_heads, self.num_query_groups)
        shape_rules.head_dim_given(self.hidden_size, self.num_attention_heads, self.kv_channels)
        shape_rules.positions(self.seq_length, self.max_position_embeddings)
        for what, value, allowed in (("recompute_granularity", self.recompute_granularity, RECOMPUTE_GRANULARITIES),
                                     ("recompute_method", self.recompute_method, RECOMPUTE_METHODS),
                                     ("attention_backend", self.attention_backend, ATTENTION_BACKENDS)):
            if value is not None and value not in allowed:
                raise ValueError(f"{what} {value!r} is not one of {allowed}")
        shape_rules.full_recompute_method(self.recompute_granularity, self.recompute_method)
        if self.recompute_num_layers < 1:
            raise ValueError(f"recompute_num_layers {self.recompute_num_layers} must be at least 1")

        if self.multi_latent_attention:
            self._check_mla()
        elif self.position_embedding_type == "rope":
            shape_rules.rope_pairs(self.rotary_percent, self.head_dim)

    def _check_mla(self) -> None:
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(f"rope_type {self.rope_type!r} is not one of {ROPE_TYPES}")
        for what in ("kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim"):
            if getattr(self, what) < 1:
                raise ValueError(f"{what} {getattr(self, what)} must be at least 1")
        if self.q_lora_rank is not None and self.q_lora_rank < 1:
            raise ValueError(f"q_lora_rank {self.q_lora_rank} must be at least 1 (or None: no q latent)")
        if self.mla_rotary_dim % 2 != 0:
            raise ValueError(f"the rotary part of qk_pos_emb_head_dim {self.qk_pos_emb_head_dim} is odd; RoPE "
                             "rotates pairs")

    @property
    def mla_rotary_dim(self) -> int:
        """MLA's rotated width: the whole position part with YaRN, rotary_percent of it with plain RoPE."""
        pos = self.qk_pos_emb_head_dim
        return pos if self.rope_type == "yarn" else int(pos * self.rotary_percent)

    def _check_moe(self) -> None:
        if self.num_experts is None:
            return
        if isinstance(self.moe_layer_freq, (list, tuple)):
            self.moe_layer_freq = tuple(self.moe_layer_freq)
            if len(self.moe_layer_freq) != self.num_layers or set(self.moe_layer_freq) - {0, 1} or self.moe_layer_offset:
                raise ValueError(f"moe_layer_freq's pattern {list(self.moe_layer_freq)} must hold one 0 or 1 per layer "
                                 f"({self.num_layers}) and moe_layer_offset be 0")
        elif self.moe_layer_freq < 1 or not 0 <= self.moe_layer_offset < self.moe_layer_freq:
            raise ValueError(f"moe_layer_freq {self.moe_layer_freq} must be at least 1 and moe_layer_offset "
                             f"{self.moe_layer_offset} lie in 0..moe_layer_freq - 1")
        if self.moe_capacity_factor is not None:
            shape_rules.capacity_gating_topk(self.moe_router_topk)
            if self.moe_eval_capacity_factor is None:
                self.moe_eval_capacity_factor = self.moe_capacity_factor
            shape_rules.capacity_factors(self.moe_capacity_factor, self.moe_eval_capacity_factor,
                                         self.moe_min_capacity)
        if self.moe_router_score_function not in ("softmax", "sigmoid"):
            raise ValueError(f"moe_router_score_function {self.moe_router_score_function!r} is not softmax or sigmoid")
        shape_rules.one_capacity(self.moe_expert_capacity_factor, self.moe_capacity_factor)
        shape_rules.capacity_padding(self.moe_pad_expert_input_to_capacity, self.moe_expert_capacity_factor)
        if self.moe_expert_capacity_factor is not None:
            if self.moe_expert_capacity_factor < 0 or self.moe_token_drop_policy not in ("probs", "position"):
                raise ValueError(f"moe_expert_capacity_factor {self.moe_expert_capacity_factor} must not be negative "
                                 f"and moe_token_drop_policy {self.moe_token_drop_policy!r} be probs or position")
        shape_rules.shared_expert_split(self.moe_shared_expert_intermediate_size, 1)
        shape_rules.shared_expert_gate(self.moe_shared_expert_gate, self.moe_shared_expert_intermediate_size)
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

    def num_moe_layers(self) -> int:
        """The MoE layers: the blocks', and the multi-token prediction depths' where the last block is one."""
        blocks = sum(self.is_moe_layer(b) for b in range(self.num_layers))
        return blocks + ((self.mtp_num_layers or 0) if self.is_moe_layer(self.num_layers - 1) else 0)

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
        """The attention's width between the heads and the output projection: heads x head_dim (MLA: v_head_dim)."""
        return self.num_attention_heads * (self.v_head_dim if self.multi_latent_attention else self.head_dim)

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
        """Raise one clear sentence if this model cannot be split `tp` ways (its experts `etp` ways, default tp):
        the command line's rules (shape_rules.py), for a model built from elsewhere."""
        shape_rules.heads_split(self.num_attention_heads, tp)
        shape_rules.ffn_split(self.ffn_hidden_size, tp)
        if self.num_experts is not None:
            shape_rules.expert_ffn_split(self.moe_ffn_hidden_size, etp or tp, etp is None or etp == tp)
            shape_rules.shared_expert_split(self.moe_shared_expert_intermediate_size, tp)
        shape_rules.query_groups_split(self.num_query_groups, tp)
        shape_rules.qkv_split(self.num_attention_heads, self.num_query_groups, self.head_dim, tp)
        shape_rules.sequence_split(self.seq_length, tp, self.sequence_parallel)

