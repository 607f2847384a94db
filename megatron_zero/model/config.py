"""The GPT model's hyper-parameters (a dataclass; layers are handed what they need)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

RECOMPUTE_GRANULARITIES = ("full", "selective")
RECOMPUTE_METHODS = ("uniform", "block")
ATTENTION_BACKENDS = ("auto", "flash", "fused", "unfused")


@dataclass
class GPTConfig:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_attention_heads: int
    seq_length: int
    max_position_embeddings: int
    ffn_hidden_size: Optional[int] = None  # None -> 4 * hidden_size
    make_vocab_size_divisible_by: int = 128
    hidden_dropout: float = 0.1
    attention_dropout: float = 0.1
    layernorm_epsilon: float = 1e-5
    init_method_std: float = 0.02
    seed: int = 1234
    params_dtype: torch.dtype = torch.float32
    # memory and speed (model/recompute.py, model/attention_core.py, sequence parallelism): none of
    # these changes a parameter, so checkpoints never record or need them
    recompute_granularity: Optional[str] = None  # None, 'full' or 'selective'
    recompute_method: Optional[str] = None       # 'uniform' or 'block' (full granularity)
    recompute_num_layers: int = 1
    attention_backend: str = "auto"
    sequence_parallel: bool = False

    def __post_init__(self):
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = 4 * self.hidden_size
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

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def padded_vocab_size(self, tp: int = 1) -> int:
        """Vocabulary rounded up to a multiple of make_vocab_size_divisible_by * tp (Megatron's rule)."""
        multiple = self.make_vocab_size_divisible_by * tp
        return -(-self.vocab_size // multiple) * multiple

    def check_tp(self, tp: int) -> None:
        """Raise one clear sentence if this model cannot be split `tp` ways."""
        for what, n in (("num_attention_heads", self.num_attention_heads), ("ffn_hidden_size", self.ffn_hidden_size)):
            if n % tp != 0:
                raise ValueError(f"{what} {n} is not divisible by the tensor-parallel size {tp}")
        if self.sequence_parallel and self.seq_length % tp != 0:
            raise ValueError(f"seq_length {self.seq_length} is not divisible by the tensor-parallel size {tp}, "
                             "which sequence parallelism splits it over")
