"""What one Hugging Face architecture module provides, and the tensor transforms they share.

A `TensorMapping` ties one of our full-form parameters (model/sharding.py: unsharded, word
embedding with the unpadded vocabulary, fused QKV in Megatron's grouped layout) to the
Hugging Face tensors it is made of, with the transforms both ways. Both directions must be
exact inverses on the bits: import then export returns the Hugging Face files unchanged.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, Tuple

import torch

from ....model.config import GPTConfig

Tensors = List[torch.Tensor]


@dataclass(frozen=True)
class TensorMapping:
    ours: str                                       # our parameter name (model/params.py)
    hf: Tuple[str, ...]                             # the Hugging Face tensors it is made of, in order
    to_ours: Callable[[Tensors], torch.Tensor]      # HF tensors (in `hf` order) -> our full tensor
    to_hf: Callable[[torch.Tensor], Tensors]        # our full tensor -> HF tensors (in `hf` order)


def same(name: str, hf_name: str) -> TensorMapping:
    """A tensor stored identically by both."""
    return TensorMapping(name, (hf_name,), lambda ts: ts[0], lambda t: [t])


def zero_centred(m: TensorMapping) -> TensorMapping:
    """A norm weight we hold zero-centred (w, --apply-layernorm-1p) and Hugging Face as the gamma it applies,
    1 + w (fp32 both ways: the export casts after the add)."""
    return TensorMapping(m.ours, m.hf, lambda ts: m.to_ours(ts).float() - 1, lambda t: m.to_hf(t.float() + 1))


def transposed(name: str, hf_name: str) -> TensorMapping:
    """A weight that Hugging Face stores as [in, out] (GPT-2's Conv1D) and we as [out, in]."""
    return TensorMapping(name, (hf_name,), lambda ts: ts[0].t(), lambda t: [t.t()])


def base_flags(config: GPTConfig) -> List[str]:
    """The Megatron flags every architecture implies: the sizes, and the settings whose Megatron default may
    differ from the Hugging Face config (dropout: ours defaults to 0.1, Llama trains with 0.0; init std)."""
    return ["--num-layers", str(config.num_layers), "--hidden-size", str(config.hidden_size),
            "--num-attention-heads", str(config.num_attention_heads), "--ffn-hidden-size", str(config.ffn_hidden_size),
            "--seq-length", str(config.seq_length), "--max-position-embeddings", str(config.max_position_embeddings),
            "--layernorm-epsilon", repr(config.layernorm_epsilon), "--hidden-dropout", repr(config.hidden_dropout),
            "--attention-dropout", repr(config.attention_dropout), "--init-method-std", repr(config.init_method_std)]
