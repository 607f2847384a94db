"""Multi-latent attention (DeepSeek-V2/V3), as Megatron-Core's MLASelfAttention, tensor-parallel.

    q  = q_up(q_norm(q_down(x)))                 [heads, qk + pos]   (q_lora_rank None: q_proj(x))
    c, k_pe = kv_down(x)                         the kv latent [kv_lora_rank] and one rotary key part [pos]
    k_nope, v = kv_up(kv_norm(c))                [heads, qk], [heads, v]
    q = [q_nope, rope(q_pe)], k = [k_nope, rope(k_pe)] (k_pe shared by the heads)
    out = dense(softmax(q k^T * mscale^2 / sqrt(qk + pos), causal) v)

The norms exist with qk_layernorm (Megatron-Core's spec: identity otherwise). RoPE acts on the
position parts in DeepSeek's interleaved pair order (Megatron-Core de-interleaves, then rotates
halves); `rope_type` yarn takes ops/yarn.py's tables (their concentration factor included), rope
the plain tables over rotary_percent of the part. mscale = yarn_mscale(rotary_scaling_factor,
mscale_all_dim), applied to q before the attention core.

Tensor parallelism as Megatron-Core splits it: the up-projections (and q_proj) column-parallel over
heads, the down-projections replicated (ReplicatedLinear), the output row-parallel. Without sequence
parallelism every rank computes the latents; k_pe enters the rank's heads through
copy_to_tensor_model_parallel_region, so its gradient (like the latents', through the column-parallel
layers) is summed over TP and the replicated weights get the whole gradient on every rank. With
sequence parallelism the down-projections and latent norms work on the rank's chunk (their gradients
summed over TP), the up-projections all-gather the normed latents and k_pe is all-gathered (its
gradient reduce-scattered). With a CP group the positions are this rank's chunks', and where the CP exchange
moves k and v as one tensor (p2p, all_gather, a2a+p2p) v travels padded with zeros to q's and k's width (the
padded context columns are zero and dropped); --v-head-dim above it is refused there (config/mla.py). So does
torch's flash attention, which takes one head dimension (`--attention-backend flash`, and `auto` on CUDA).
"""
from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from ..context_parallel import context_parallel_attention
from ..ops import rotary_tables
from ..ops.yarn import yarn_mscale, yarn_rotary_tables
from ..tensor_parallel import (ColumnParallelLinear, RowParallelLinear, copy_to_tensor_model_parallel_region,
                               gather_from_sequence_parallel_region)
from ..tensor_parallel.random import checkpoint
from ..tensor_parallel.replicated_linear import ReplicatedLinear
from ..tensor_parallel.utils import divide, tp_world_size
from . import functional
from .attention_core import attention_core
from .config import GPTConfig
from .norms import LayerNorm, RMSNorm, sequence_parallel_active
from .positions import local_positions


def mla_flop_sizes(config: GPTConfig):
    """(the attention's weights per layer, heads x (q head + v head)) for throughput.gpt_flops_per_iteration, or
    None for a model without MLA."""
    c = config
    if not c.multi_latent_attention:
        return None
    heads, q_head = c.num_attention_heads, c.qk_head_dim + c.qk_pos_emb_head_dim
    h = c.hidden_size
    q = h * heads * q_head if c.q_lora_rank is None else c.q_lora_rank * (h + heads * q_head)
    kv = h * (c.kv_lora_rank + c.qk_pos_emb_head_dim) + c.kv_lora_rank * heads * (c.qk_head_dim + c.v_head_dim)
    return q + kv + heads * c.v_head_dim * h, heads * (q_head + c.v_head_dim)


class MLARotary:
    """cos/sin tables of MLA's position part (rope or yarn), built once per sequence length and device."""

    def __init__(self, config: GPTConfig):
        self.config, self._tables = config, {}

    def _build(self, seq_len: int, device):
        c = self.config
        if c.rope_type == "yarn":
            return yarn_rotary_tables(seq_len, c.qk_pos_emb_head_dim, c.rotary_base, c.rotary_scaling_factor,
                                      c.original_max_position_embeddings, c.beta_fast, c.beta_slow, c.mscale,
                                      c.mscale_all_dim, device)
        return rotary_tables(seq_len, c.mla_rotary_dim, c.rotary_base, device)

    def __call__(self, seq_len: int, device, cp_group=None):
        key = (seq_len, str(device))
        if key not in self._tables:
            if cp_group is None:
                self._tables[key] = self._build(seq_len, device)
            else:
                cos, sin = self._build(seq_len * tp_world_size(cp_group), device)
                rows = local_positions(seq_len, cp_group, device)
                self._tables[key] = cos[rows].contiguous(), sin[rows].contiguous()
        return self._tables[key]


def apply_interleaved_rope(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on t [..., s, d] whose rotated pairs are interleaved (x0 x1, x2 x3, ...): the first cos.shape[-1]
    features reordered to [even; odd], then rotated by halves (Megatron-Core's multi_latent_attention path)."""
    rot = cos.shape[-1]
    t_rot, t_pass = t[..., :rot], t[..., rot:]
    t_rot = torch.cat((t_rot[..., 0::2], t_rot[..., 1::2]), dim=-1)
    return torch.cat((functional.apply_rotary_pos_emb(t_rot, cos, sin), t_pass), dim=-1)


def _latent_norm(config: GPTConfig, size: int, sp_group) -> nn.Module:
    norm = RMSNorm if config.normalization == "RMSNorm" else LayerNorm
    return norm(size, config.layernorm_epsilon, config.params_dtype, sp_group, zero_centered=config.apply_layernorm_1p)


class MultiLatentAttention(nn.Module):
    """Causal multi-latent self-attention; each TP rank owns num_heads / tp whole heads (see the module docstring)."""

    def __init__(self, config: GPTConfig, tp_group=None, cp_group=None, cp_hierarchy=None):
        super().__init__()
        c, h, dtype = config, config.hidden_size, config.params_dtype
        self.tp_group, self.cp_group, self.cp_comm_type, self.cp_hierarchy = tp_group, cp_group, c.cp_comm_type, cp_hierarchy
        self.sequence_parallel = sequence_parallel_active(c, tp_group)
        sp_group = tp_group if self.sequence_parallel else None
        self.local_heads = divide(c.num_attention_heads, tp_world_size(tp_group))
        self.qk_head_dim, self.pos_dim, self.v_head_dim = c.qk_head_dim, c.qk_pos_emb_head_dim, c.v_head_dim
        self.kv_lora_rank = c.kv_lora_rank
        q_out = c.num_attention_heads * (c.qk_head_dim + c.qk_pos_emb_head_dim)
        column = dict(bias=False, params_dtype=dtype, sequence_parallel=self.sequence_parallel)
        if c.q_lora_rank is None:
            self.linear_q_proj = ColumnParallelLinear(h, q_out, tp_group, **column)
        else:
            self.linear_q_down_proj = ReplicatedLinear(h, c.q_lora_rank, sp_group, params_dtype=dtype)
            self.linear_q_up_proj = ColumnParallelLinear(c.q_lora_rank, q_out, tp_group, **column)
        self.linear_kv_down_proj = ReplicatedLinear(h, c.kv_lora_rank + c.qk_pos_emb_head_dim, sp_group,
                                                    params_dtype=dtype)
        self.linear_kv_up_proj = ColumnParallelLinear(c.kv_lora_rank, c.num_attention_heads * (c.qk_head_dim +
                                                      c.v_head_dim), tp_group, **column)
        self.dense = RowParallelLinear(c.query_projection_size, h, tp_group, bias=c.add_bias_linear,
                                       input_is_parallel=True, params_dtype=dtype,
                                       sequence_parallel=self.sequence_parallel)
        if c.qk_layernorm:
            if c.q_lora_rank is not None:
                self.q_layernorm = _latent_norm(c, c.q_lora_rank, sp_group)
            self.kv_layernorm = _latent_norm(c, c.kv_lora_rank, sp_group)
        self.rotary = MLARotary(c)
        mscale = yarn_mscale(c.rotary_scaling_factor, c.mscale_all_dim)
        self.q_scale = mscale * mscale  # the softmax's extra factor (1/sqrt(d) is the core's)
        self.dropout_p, self.backend = c.attention_dropout, c.attention_backend
        self.recompute_core = c.recompute_granularity == "selective"
        self.max_logit = None  # QK-clip does not reach MLA's projections (config/mla.py refuses it)

    def _query(self, x):
        if hasattr(self, "linear_q_proj"):
            return self.linear_q_proj(x)
        latent = self.linear_q_down_proj(x)
        if hasattr(self, "q_layernorm"):
            latent = self.q_layernorm(latent)
        return self.linear_q_up_proj(latent)

    def forward(self, x):
        q = self._query(x)  # [b, s, local heads (qk + pos)], the whole sequence also under SP
        latent, k_pe = self.linear_kv_down_proj(x).split([self.kv_lora_rank, self.pos_dim], dim=-1)
        if hasattr(self, "kv_layernorm"):
            latent = self.kv_layernorm(latent)
        kv = self.linear_kv_up_proj(latent)
        if self.sequence_parallel:
            k_pe = gather_from_sequence_parallel_region(k_pe, self.tp_group)
        else:
            k_pe = copy_to_tensor_model_parallel_region(k_pe, self.tp_group)
        b, s, _ = q.shape
        q = q.view(b, s, self.local_heads, -1).transpose(1, 2)
        k_nope, v = kv.view(b, s, self.local_heads, -1).transpose(1, 2).split([self.qk_head_dim, self.v_head_dim], -1)
        q_nope, q_pe = q.split([self.qk_head_dim, self.pos_dim], dim=-1)
        cos, sin = self.rotary(s, x.device, self.cp_group)
        q_pe = apply_interleaved_rope(q_pe, cos, sin)
        k_pe = apply_interleaved_rope(k_pe.unsqueeze(1), cos, sin).expand(-1, self.local_heads, -1, -1)
        q, k = torch.cat((q_nope, q_pe), dim=-1), torch.cat((k_nope, k_pe), dim=-1)
        if self.q_scale != 1.0:
            q = q * self.q_scale
        context = checkpoint(self._core, q, k, v) if self.recompute_core else self._core(q, k, v)
        return self.dense(context.transpose(1, 2).reshape(b, s, self.local_heads * self.v_head_dim))

    def _core(self, q, k, v):
        """Causal attention of q, k [b, heads, s, qk + pos] and v [b, heads, s, v] -> [b, heads, s, v]."""
        pad = q.shape[-1] - v.shape[-1] if self._pads_v(q) else 0
        if pad > 0:
            v = F.pad(v, (0, pad))
        if self.cp_group is not None:
            core = partial(attention_core, backend=self.backend, dropout_p=self.dropout_p, training=self.training)
            out = context_parallel_attention(q, k, v, self.cp_group, self.cp_comm_type, core,
                                             self.dropout_p if self.training else 0.0, self.cp_hierarchy, self.backend)
        else:
            out = attention_core(q, k.contiguous(), v.contiguous(), self.backend, self.dropout_p, self.training)
        return out[..., :self.v_head_dim] if pad > 0 else out

    def _pads_v(self, q) -> bool:
        """Whether v goes in padded with zeros to q's width (the padded context columns are zero and dropped): for
        the CP exchanges that move k and v as one tensor (all but a2a) and torch's flash kernels, which take one
        head dimension (--attention-backend flash, and auto on CUDA)."""
        return ((self.cp_group is not None and self.cp_comm_type != "a2a") or self.backend == "flash"
                or (self.backend == "auto" and q.is_cuda))
