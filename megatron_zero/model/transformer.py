"""The transformer pieces as Megatron builds them, tensor-parallel: embedding, norms, attention, MLP, block,
and the untied output head.

Activations are batch-first [b, s, h]. Inside a block the attention heads and the
MLP's ffn features are split across TP ranks; the residual stream is replicated, or
with sequence parallelism split along s over the TP ranks (each holds [b, s/tp, h]:
norms, dropout and residual adds work on that chunk; the column-parallel layers
all-gather it, the row-parallel layers reduce-scatter back to it). Dropout on a
TP-split activation draws per-rank masks inside the RNG tracker's fork.
GPT-2 is the default; the config's architecture switches give the Llama family
(RMSNorm, RoPE, SwiGLU, grouped-query attention, no linear biases, untied head).
Given a context-parallel group (`cp_group`), s is this CP rank's two chunks of the sequence
(context_parallel/chunks.py): positions (learned or RoPE) are the chunks' own, and attention runs
over the whole sequence through context_parallel/ (`config.cp_comm_type`).
"""
from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from ..context_parallel import context_parallel_attention
from ..ops import rotary_tables
from ..tensor_parallel import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding,
                               all_gather_last_dim_from_tensor_parallel_region,
                               gather_from_sequence_parallel_region,
                               get_rng_tracker, scatter_to_sequence_parallel_region)
from ..tensor_parallel.random import checkpoint
from ..tensor_parallel.linear_async import linear_with_async_grad_all_reduce
from ..tensor_parallel.output_loss import vocab_parallel_linear_cross_entropy
from ..tensor_parallel.utils import divide, set_tensor_model_parallel_attributes, tp_rank_in, tp_world_size
from . import functional
from .attention_core import attention_core
from .config import GPTConfig
from .norms import LayerNorm, RMSNorm, build_head_norm, build_norm, sequence_parallel_active  # noqa: F401
from .positions import local_positions  # noqa: F401


def dropout(x, p: float, training: bool, per_tp_rank: bool):
    """F.dropout; `per_tp_rank` (a TP-split activation) draws from the RNG tracker's per-rank stream."""
    if not (training and p > 0):
        return x
    if per_tp_rank:
        with get_rng_tracker().fork():
            return F.dropout(x, p, True)
    return F.dropout(x, p, True)


class Embedding(nn.Module):
    """Word (vocab-parallel) embedding, plus learned positions if the config has them, then hidden dropout;
    when tied, also the output head."""

    def __init__(self, config: GPTConfig, tp_group=None, cp_group=None):
        super().__init__()
        self.config, self.tp_group, self.cp_group = config, tp_group, cp_group
        self.sequence_parallel = sequence_parallel_active(config, tp_group)
        padded = config.padded_vocab_size(tp_world_size(tp_group))
        self.word_embeddings = VocabParallelEmbedding(padded, config.hidden_size, tp_group, config.params_dtype)
        if config.has_position_embeddings:
            positions = torch.zeros(config.max_position_embeddings, config.hidden_size, dtype=config.params_dtype)
            self.position_embeddings = nn.Embedding(*positions.shape, _weight=positions)  # no draw from the RNG
            set_tensor_model_parallel_attributes(self.position_embeddings.weight, False)

    def forward(self, tokens, positions=None):
        """`positions`: the learned positions' rows [s] (default this rank's own; multi-token prediction's
        are shifted with its tokens)."""
        x = self.word_embeddings(tokens)
        if self.config.has_position_embeddings:
            if positions is None:
                positions = local_positions(tokens.shape[1], self.cp_group, tokens.device)
            x = x + self.position_embeddings(positions).unsqueeze(0)
        if self.sequence_parallel:
            # the scatter returns a view, which would keep the whole [b, s, h] alive as long as the shard
            # (a recomputed layer saves its input): a copy of this rank's tokens frees it (Megatron clones too)
            x = scatter_to_sequence_parallel_region(x, self.tp_group).clone()
        return dropout(x, self.config.hidden_dropout, self.training, self.sequence_parallel)

    def lm_logits(self, hidden):
        """This TP rank's slice of the vocabulary logits [b, s, V_padded / tp] (whole sequence)."""
        if self.sequence_parallel:
            hidden = gather_from_sequence_parallel_region(hidden, self.tp_group)
        elif tp_world_size(self.tp_group) > 1:
            return linear_with_async_grad_all_reduce(hidden, self.word_embeddings.weight, None, self.tp_group)
        return F.linear(hidden, self.word_embeddings.weight)

    def lm_losses(self, hidden, labels):
        """Per-token losses [b, s] of the tied output layer, without its logits (tensor_parallel/output_loss.py)."""
        return vocab_parallel_linear_cross_entropy(hidden, self.word_embeddings.weight, labels, self.tp_group,
                                                   self.config.vocab_size, self.sequence_parallel)


class LMHead(nn.Module):
    """The untied output layer (Megatron-DeepSpeed's LMHeadPipe): a vocab-parallel linear, no bias."""

    def __init__(self, config: GPTConfig, tp_group=None):
        super().__init__()
        self.config, self.tp_group = config, tp_group
        padded = config.padded_vocab_size(tp_world_size(tp_group))
        self.lm_head = ColumnParallelLinear(config.hidden_size, padded, tp_group, bias=False,
                                            params_dtype=config.params_dtype,
                                            sequence_parallel=sequence_parallel_active(config, tp_group))

    def forward(self, hidden, labels=None):
        """This TP rank's slice of the vocabulary logits [b, s, V_padded / tp] (whole sequence); given
        `labels`, the per-token losses [b, s] instead, without the logits (tensor_parallel/output_loss.py)."""
        if labels is None:
            return self.lm_head(hidden)
        return vocab_parallel_linear_cross_entropy(hidden, self.lm_head.weight, labels, self.tp_group,
                                                   self.config.vocab_size, self.lm_head.sequence_parallel)


class RotaryEmbedding:
    """cos/sin tables for RoPE, built once per sequence length and device (no parameters, nothing saved)."""

    def __init__(self, config: GPTConfig):
        self.dim, self.base = config.rotary_dim, config.rotary_base
        self._tables = {}

    def __call__(self, seq_len: int, device, cp_group=None):
        """cos, sin [seq_len, rotary_dim]; with `cp_group`, seq_len is this rank's and the rows are its positions."""
        key = (seq_len, str(device))
        if key not in self._tables:
            if cp_group is None:
                self._tables[key] = rotary_tables(seq_len, self.dim, self.base, device)
            else:
                cos, sin = rotary_tables(seq_len * tp_world_size(cp_group), self.dim, self.base, device)
                rows = local_positions(seq_len, cp_group, device)
                self._tables[key] = cos[rows].contiguous(), sin[rows].contiguous()
        return self._tables[key]


class QKVSplit:
    """This TP rank's query, key and value heads out of its slice of the fused, grouped QKV output.

    The full QKV rows are, per query group, [q heads of the group, k, v]. With num_query_groups
    >= tp each rank's contiguous slice holds whole groups. With fewer groups than ranks
    (Megatron's KV replication) the slices are all-gathered, each rank takes its group's block,
    and keeps its num_heads / tp query heads of that group; the ranks sharing a group compute
    its k and v redundantly.
    """

    def __init__(self, config: GPTConfig, tp_group=None):
        tp, groups = tp_world_size(tp_group), config.num_query_groups
        self.tp_group, self.head_dim = tp_group, config.head_dim
        self.local_heads = divide(config.num_attention_heads, tp)
        self.gather = groups < tp
        if self.gather:
            ranks_per_group = tp // groups
            rank = tp_rank_in(tp_group)
            self.group_index, self.q_index = rank // ranks_per_group, rank % ranks_per_group
            self.local_groups = 1
            self.heads_per_group = config.num_attention_heads // groups
        else:
            self.local_groups = groups // tp
            self.heads_per_group = self.local_heads // self.local_groups

    def __call__(self, mixed: torch.Tensor):
        """mixed [b, s, local QKV rows] -> q [b, local_heads, s, hd], k and v [b, local_groups, s, hd]."""
        b, s, _ = mixed.shape
        hd = self.head_dim
        if self.gather:
            mixed = all_gather_last_dim_from_tensor_parallel_region(mixed, self.tp_group)
            size = (self.heads_per_group + 2) * hd
            mixed = mixed[..., self.group_index * size:(self.group_index + 1) * size]
        mixed = mixed.reshape(b, s, self.local_groups, (self.heads_per_group + 2) * hd)
        q, k, v = mixed.split([self.heads_per_group * hd, hd, hd], dim=-1)
        q = q.reshape(b, s, self.local_groups * self.heads_per_group, hd)
        if self.gather:
            q = q[:, :, self.q_index * self.local_heads:(self.q_index + 1) * self.local_heads]
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)


class ParallelAttention(nn.Module):
    """Causal self-attention; each TP rank owns num_heads / tp whole query heads (see QKVSplit).
    The core (softmax(q k^T) v) is one of the backends of attention_core.py."""

    def __init__(self, config: GPTConfig, tp_group=None, cp_group=None, cp_hierarchy=None):
        super().__init__()
        h = config.hidden_size
        self.head_dim, self.cp_group, self.cp_comm_type = config.head_dim, cp_group, config.cp_comm_type
        self.cp_hierarchy = cp_hierarchy  # a2a+p2p: (all-to-all group, ring group)
        self.split_qkv = QKVSplit(config, tp_group)
        self.local_heads = self.split_qkv.local_heads
        self.rotary = RotaryEmbedding(config) if config.position_embedding_type == "rope" else None
        self.dropout_p, self.backend = config.attention_dropout, config.attention_backend
        self.recompute_core = config.recompute_granularity == "selective"
        self.max_logit = None  # a recorder of each head's max logit, set by optimizer/qk_clip.py where asked
        bias, sp = config.add_bias_linear, sequence_parallel_active(config, tp_group)
        self.query_key_value = ColumnParallelLinear(h, config.qkv_size, tp_group, bias=bias or config.add_qkv_bias,
                                                    params_dtype=config.params_dtype, sequence_parallel=sp)
        self.dense = RowParallelLinear(config.query_projection_size, h, tp_group, bias=bias, input_is_parallel=True,
                                       params_dtype=config.params_dtype, sequence_parallel=sp)
        if config.qk_layernorm:  # one norm over each head's q (k), shared by the heads: its gradient summed over TP
            self.q_layernorm, self.k_layernorm = (build_head_norm(config, tp_group) for _ in range(2))

    def forward(self, x):
        q, k, v = self.split_qkv(self.query_key_value(x))  # [b, heads or groups, s, hd]
        b, _, s, _ = q.shape  # the whole sequence (CP: this rank's chunks), also when x is a sequence-parallel chunk
        if hasattr(self, "q_layernorm"):
            q, k = self.q_layernorm(q), self.k_layernorm(k)
        if self.rotary is not None:
            cos, sin = self.rotary(s, x.device, self.cp_group)
            q, k = functional.apply_rotary_pos_emb(q, cos, sin), functional.apply_rotary_pos_emb(k, cos, sin)
        if self.max_logit is not None and self.training:  # QK-clip / --log-max-attention-logit (optimizer/qk_clip.py)
            self.max_logit.record(q, k, self.cp_group)
        core = partial(attention_core, backend=self.backend, dropout_p=self.dropout_p, training=self.training)
        if self.cp_group is not None:  # only the KV heads travel; expanded where they are used
            core = partial(context_parallel_attention, cp_group=self.cp_group, comm_type=self.cp_comm_type,
                           core=core, dropout_p=self.dropout_p if self.training else 0.0, hierarchy=self.cp_hierarchy,
                           backend=self.backend)
        else:
            k, v = expand_kv_heads(k, self.local_heads), expand_kv_heads(v, self.local_heads)
        context = checkpoint(core, q, k, v) if self.recompute_core else core(q, k, v)
        return self.dense(context.transpose(1, 2).reshape(b, s, self.local_heads * self.head_dim))


def expand_kv_heads(t: torch.Tensor, heads: int) -> torch.Tensor:
    """[b, groups, s, hd] -> [b, heads, s, hd]: each group's head serves heads / groups query heads in a row."""
    groups = t.shape[1]
    return t if groups == heads else t.repeat_interleave(heads // groups, dim=1)


class ParallelMLP(nn.Module):
    """h -> ffn (column-parallel) -> GeLU, or SwiGLU over [gate; up] -> h (row-parallel).
    `ffn_hidden_size`: another width than the config's (an MoE expert's)."""

    def __init__(self, config: GPTConfig, tp_group=None, ffn_hidden_size=None):
        super().__init__()
        h, f, bias = config.hidden_size, ffn_hidden_size or config.ffn_hidden_size, config.add_bias_linear
        self.swiglu = config.swiglu
        sp = sequence_parallel_active(config, tp_group)
        self.dense_h_to_4h = ColumnParallelLinear(h, 2 * f if self.swiglu else f, tp_group, bias=bias,
                                                  skip_bias_add=True,
                                                  params_dtype=config.params_dtype, sequence_parallel=sp)
        self.dense_4h_to_h = RowParallelLinear(f, h, tp_group, bias=bias, input_is_parallel=True,
                                               params_dtype=config.params_dtype, sequence_parallel=sp)

    def forward(self, x):
        y, bias = self.dense_h_to_4h(x)
        if self.swiglu:
            return self.dense_4h_to_h(functional.swiglu(y if bias is None else y + bias))
        if bias is None:
            return self.dense_4h_to_h(F.gelu(y, approximate="tanh"))
        return self.dense_4h_to_h(functional.bias_gelu(bias, y))


class ParallelTransformerLayer(nn.Module):
    """Pre-norm block: x + drop(attn(norm(x))), then + drop(mlp(norm(.))).

    Hidden dropout is replicated over TP, or with sequence parallelism drawn per rank on its chunk.
    Block `block` (0-based) has an MoE layer as its `mlp` where config.is_moe_layer(block) (its experts
    spread over `ep_group`, None: all here; tensor-parallel over `etp_group`, None: over tp_group).
    """

    def __init__(self, config: GPTConfig, tp_group=None, cp_group=None, block: int = 0, ep_group=None,
                 etp_group=None, cp_hierarchy=None):
        super().__init__()
        self.hidden_dropout = config.hidden_dropout
        self.sequence_parallel = sequence_parallel_active(config, tp_group)
        self.input_layernorm = build_norm(config, tp_group)
        if config.multi_latent_attention:
            from .mla import MultiLatentAttention
            self.self_attention = MultiLatentAttention(config, tp_group, cp_group, cp_hierarchy)
        else:
            self.self_attention = ParallelAttention(config, tp_group, cp_group, cp_hierarchy)
        self.post_attention_layernorm = build_norm(config, tp_group)
        if config.is_moe_layer(block):
            from ..moe import MoELayer
            self.mlp = MoELayer(config, tp_group, ep_group, ParallelMLP, etp_group, cp_group)
        else:
            self.mlp = ParallelMLP(config, tp_group)

    def forward(self, x):
        p, sp = self.hidden_dropout, self.sequence_parallel
        x = x + dropout(self.self_attention(self.input_layernorm(x)), p, self.training, sp)
        return x + dropout(self.mlp(self.post_attention_layernorm(x)), p, self.training, sp)
