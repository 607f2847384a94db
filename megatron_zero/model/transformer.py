"""The GPT-2 pieces as Megatron builds them, tensor-parallel: embedding, LayerNorm, attention, MLP, block.

Activations are batch-first [b, s, h]. Inside a block the attention heads and the
MLP's 4h features are split across TP ranks; the residual stream is replicated, or
with sequence parallelism split along s over the TP ranks (each holds [b, s/tp, h]:
LayerNorms, dropout and residual adds work on that chunk; the column-parallel layers
all-gather it, the row-parallel layers reduce-scatter back to it). Dropout on a
TP-split activation draws per-rank masks inside the RNG tracker's fork.
"""
from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from ..tensor_parallel import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding,
                               copy_to_tensor_model_parallel_region, gather_from_sequence_parallel_region,
                               get_rng_tracker, scatter_to_sequence_parallel_region)
from ..tensor_parallel.layers import sequence_parallel_param, sum_sequence_parallel_grad
from ..tensor_parallel.utils import divide, set_tensor_model_parallel_attributes, tp_world_size
from . import functional
from .attention_core import attention_core
from .config import GPTConfig
from .recompute import checkpoint


def sequence_parallel_active(config: GPTConfig, tp_group) -> bool:
    return config.sequence_parallel and tp_world_size(tp_group) > 1


def dropout(x, p: float, training: bool, per_tp_rank: bool):
    """F.dropout; `per_tp_rank` (a TP-split activation) draws from the RNG tracker's per-rank stream."""
    if not (training and p > 0):
        return x
    if per_tp_rank:
        with get_rng_tracker().fork():
            return F.dropout(x, p, True)
    return F.dropout(x, p, True)


class LayerNorm(nn.Module):
    """LayerNorm with `weight` and `bias`, replicated across TP.

    Given `sequence_parallel_group` it normalises a sequence chunk: its parameters are marked
    `sequence_parallel` and their gradients summed over that group in backward.
    """

    def __init__(self, hidden_size: int, eps: float, dtype=torch.float32, sequence_parallel_group=None):
        super().__init__()
        self.eps, self.tp_group = eps, sequence_parallel_group
        self.weight = set_tensor_model_parallel_attributes(nn.Parameter(torch.ones(hidden_size, dtype=dtype)), False)
        self.bias = set_tensor_model_parallel_attributes(nn.Parameter(torch.zeros(hidden_size, dtype=dtype)), False)
        if sequence_parallel_group is not None:
            sequence_parallel_param(self.weight)
            sequence_parallel_param(self.bias)

    def forward(self, x):
        weight, bias = (sum_sequence_parallel_grad(p, self.tp_group) for p in (self.weight, self.bias))
        return functional.layer_norm(x, weight, bias, self.eps)


def layer_norm_for(config: GPTConfig, tp_group) -> LayerNorm:
    """A LayerNorm for the residual stream (sequence-parallel when the model is)."""
    sp_group = tp_group if sequence_parallel_active(config, tp_group) else None
    return LayerNorm(config.hidden_size, config.layernorm_epsilon, config.params_dtype, sp_group)


class Embedding(nn.Module):
    """Word (vocab-parallel) + learned position embeddings, then hidden dropout; also the tied output head."""

    def __init__(self, config: GPTConfig, tp_group=None):
        super().__init__()
        self.config, self.tp_group = config, tp_group
        self.sequence_parallel = sequence_parallel_active(config, tp_group)
        padded = config.padded_vocab_size(tp_world_size(tp_group))
        self.word_embeddings = VocabParallelEmbedding(padded, config.hidden_size, tp_group, config.params_dtype)
        positions = torch.zeros(config.max_position_embeddings, config.hidden_size, dtype=config.params_dtype)
        self.position_embeddings = nn.Embedding(*positions.shape, _weight=positions)  # no draw from the RNG
        set_tensor_model_parallel_attributes(self.position_embeddings.weight, False)

    def forward(self, tokens):
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.word_embeddings(tokens) + self.position_embeddings(positions).unsqueeze(0)
        if self.sequence_parallel:
            x = scatter_to_sequence_parallel_region(x, self.tp_group)
        return dropout(x, self.config.hidden_dropout, self.training, self.sequence_parallel)

    def lm_logits(self, hidden):
        """This TP rank's slice of the vocabulary logits [b, s, V_padded / tp] (whole sequence)."""
        if self.sequence_parallel:
            hidden = gather_from_sequence_parallel_region(hidden, self.tp_group)
        else:
            hidden = copy_to_tensor_model_parallel_region(hidden, self.tp_group)
        return F.linear(hidden, self.word_embeddings.weight)


class ParallelAttention(nn.Module):
    """Causal self-attention; each TP rank owns num_heads / tp whole heads.

    The fused QKV output is laid out per head: [heads, (q, k, v), head_dim].
    """

    def __init__(self, config: GPTConfig, tp_group=None):
        super().__init__()
        h = config.hidden_size
        self.head_dim = config.head_dim
        self.local_heads = divide(config.num_attention_heads, tp_world_size(tp_group))
        self.dropout_p, self.backend = config.attention_dropout, config.attention_backend
        self.recompute_core = config.recompute_granularity == "selective"
        sp = sequence_parallel_active(config, tp_group)
        self.query_key_value = ColumnParallelLinear(h, 3 * h, tp_group, params_dtype=config.params_dtype,
                                                    sequence_parallel=sp)
        self.dense = RowParallelLinear(h, h, tp_group, input_is_parallel=True, params_dtype=config.params_dtype,
                                       sequence_parallel=sp)

    def forward(self, x):
        qkv = self.query_key_value(x)
        b, s = qkv.shape[:2]  # the whole sequence, also when x is a sequence-parallel chunk
        qkv = qkv.view(b, s, self.local_heads, 3 * self.head_dim)
        q, k, v = (t.transpose(1, 2) for t in qkv.split(self.head_dim, dim=-1))  # [b, np, s, hd]
        core = partial(attention_core, backend=self.backend, dropout_p=self.dropout_p, training=self.training)
        context = checkpoint(core, q, k, v) if self.recompute_core else core(q, k, v)
        return self.dense(context.transpose(1, 2).reshape(b, s, self.local_heads * self.head_dim))


class ParallelMLP(nn.Module):
    """h -> ffn (column-parallel) -> GeLU -> h (row-parallel)."""

    def __init__(self, config: GPTConfig, tp_group=None):
        super().__init__()
        h, f = config.hidden_size, config.ffn_hidden_size
        sp = sequence_parallel_active(config, tp_group)
        self.dense_h_to_4h = ColumnParallelLinear(h, f, tp_group, skip_bias_add=True, params_dtype=config.params_dtype,
                                                  sequence_parallel=sp)
        self.dense_4h_to_h = RowParallelLinear(f, h, tp_group, input_is_parallel=True, params_dtype=config.params_dtype,
                                               sequence_parallel=sp)

    def forward(self, x):
        y, bias = self.dense_h_to_4h(x)
        return self.dense_4h_to_h(functional.bias_gelu(bias, y))


class ParallelTransformerLayer(nn.Module):
    """Pre-LayerNorm block: x + drop(attn(ln(x))), then + drop(mlp(ln(.))).

    Hidden dropout is replicated over TP, or with sequence parallelism drawn per rank on its chunk.
    """

    def __init__(self, config: GPTConfig, tp_group=None):
        super().__init__()
        self.hidden_dropout = config.hidden_dropout
        self.sequence_parallel = sequence_parallel_active(config, tp_group)
        self.input_layernorm = layer_norm_for(config, tp_group)
        self.self_attention = ParallelAttention(config, tp_group)
        self.post_attention_layernorm = layer_norm_for(config, tp_group)
        self.mlp = ParallelMLP(config, tp_group)

    def forward(self, x):
        p, sp = self.hidden_dropout, self.sequence_parallel
        x = x + dropout(self.self_attention(self.input_layernorm(x)), p, self.training, sp)
        return x + dropout(self.mlp(self.post_attention_layernorm(x)), p, self.training, sp)
