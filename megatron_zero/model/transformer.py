"""The GPT-2 pieces as Megatron builds them, tensor-parallel: embedding, LayerNorm, attention, MLP, block.

Activations are batch-first [b, s, h]. Inside a block the attention heads and the
MLP's 4h features are split across TP ranks; the residual stream is replicated.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..tensor_parallel import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding,
                               copy_to_tensor_model_parallel_region, get_rng_tracker)
from ..tensor_parallel.utils import divide, set_tensor_model_parallel_attributes, tp_world_size
from . import functional
from .config import GPTConfig


class LayerNorm(nn.Module):
    """LayerNorm with `weight` and `bias`, replicated across TP."""

    def __init__(self, hidden_size: int, eps: float, dtype=torch.float32):
        super().__init__()
        self.eps = eps
        self.weight = set_tensor_model_parallel_attributes(nn.Parameter(torch.ones(hidden_size, dtype=dtype)), False)
        self.bias = set_tensor_model_parallel_attributes(nn.Parameter(torch.zeros(hidden_size, dtype=dtype)), False)

    def forward(self, x):
        return functional.layer_norm(x, self.weight, self.bias, self.eps)


class Embedding(nn.Module):
    """Word (vocab-parallel) + learned position embeddings, then hidden dropout; also the tied output head."""

    def __init__(self, config: GPTConfig, tp_group=None):
        super().__init__()
        self.config, self.tp_group = config, tp_group
        padded = config.padded_vocab_size(tp_world_size(tp_group))
        self.word_embeddings = VocabParallelEmbedding(padded, config.hidden_size, tp_group, config.params_dtype)
        positions = torch.zeros(config.max_position_embeddings, config.hidden_size, dtype=config.params_dtype)
        self.position_embeddings = nn.Embedding(*positions.shape, _weight=positions)  # no draw from the RNG
        set_tensor_model_parallel_attributes(self.position_embeddings.weight, False)

    def forward(self, tokens):
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.word_embeddings(tokens) + self.position_embeddings(positions).unsqueeze(0)
        return F.dropout(x, self.config.hidden_dropout, self.training)

    def lm_logits(self, hidden):
        """This TP rank's slice of the vocabulary logits [b, s, V_padded / tp]."""
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
        self.dropout_p = config.attention_dropout
        self.query_key_value = ColumnParallelLinear(h, 3 * h, tp_group, params_dtype=config.params_dtype)
        self.dense = RowParallelLinear(h, h, tp_group, input_is_parallel=True, params_dtype=config.params_dtype)

    def forward(self, x):
        b, s, _ = x.shape
        qkv = self.query_key_value(x).view(b, s, self.local_heads, 3 * self.head_dim)
        q, k, v = (t.transpose(1, 2) for t in qkv.split(self.head_dim, dim=-1))  # [b, np, s, hd]
        probs = functional.scaled_upper_triang_masked_softmax(q @ k.transpose(-2, -1), 1.0 / math.sqrt(self.head_dim))
        if self.training and self.dropout_p > 0:
            with get_rng_tracker().fork():  # heads differ per TP rank: draw per-rank masks
                probs = F.dropout(probs, self.dropout_p, True)
        context = (probs @ v).transpose(1, 2).reshape(b, s, self.local_heads * self.head_dim)
        return self.dense(context)


class ParallelMLP(nn.Module):
    """h -> ffn (column-parallel) -> GeLU -> h (row-parallel)."""

    def __init__(self, config: GPTConfig, tp_group=None):
        super().__init__()
        h, f = config.hidden_size, config.ffn_hidden_size
        self.dense_h_to_4h = ColumnParallelLinear(h, f, tp_group, skip_bias_add=True, params_dtype=config.params_dtype)
        self.dense_4h_to_h = RowParallelLinear(f, h, tp_group, input_is_parallel=True, params_dtype=config.params_dtype)

    def forward(self, x):
        y, bias = self.dense_h_to_4h(x)
        return self.dense_4h_to_h(functional.bias_gelu(bias, y))


class ParallelTransformerLayer(nn.Module):
    """Pre-LayerNorm block: x + drop(attn(ln(x))), then + drop(mlp(ln(.))). Hidden dropout is replicated."""

    def __init__(self, config: GPTConfig, tp_group=None):
        super().__init__()
        self.hidden_dropout = config.hidden_dropout
        eps, dtype = config.layernorm_epsilon, config.params_dtype
        self.input_layernorm = LayerNorm(config.hidden_size, eps, dtype)
        self.self_attention = ParallelAttention(config, tp_group)
        self.post_attention_layernorm = LayerNorm(config.hidden_size, eps, dtype)
        self.mlp = ParallelMLP(config, tp_group)

    def forward(self, x):
        x = x + F.dropout(self.self_attention(self.input_layernorm(x)), self.hidden_dropout, self.training)
        return x + F.dropout(self.mlp(self.post_attention_layernorm(x)), self.hidden_dropout, self.training)
