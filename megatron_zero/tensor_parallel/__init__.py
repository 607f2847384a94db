"""Tensor parallelism: mappings, parallel layers, vocab-parallel cross-entropy, the RNG tracker."""
from .cross_entropy import vocab_parallel_cross_entropy
from .layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from .mappings import (all_gather_last_dim_from_tensor_parallel_region, copy_to_tensor_model_parallel_region,
                       gather_from_sequence_parallel_region, gather_from_tensor_model_parallel_region,
                       reduce_from_tensor_model_parallel_region, reduce_scatter_to_sequence_parallel_region,
                       scatter_to_sequence_parallel_region, scatter_to_tensor_model_parallel_region)
from .random import get_rng_tracker, model_parallel_seed
from .utils import param_is_tp_duplicate, set_tensor_model_parallel_attributes

__all__ = [
    "ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "vocab_parallel_cross_entropy",
    "all_gather_last_dim_from_tensor_parallel_region", "copy_to_tensor_model_parallel_region",
    "reduce_from_tensor_model_parallel_region",
    "scatter_to_tensor_model_parallel_region", "gather_from_tensor_model_parallel_region",
    "scatter_to_sequence_parallel_region", "gather_from_sequence_parallel_region",
    "reduce_scatter_to_sequence_parallel_region",
    "get_rng_tracker", "model_parallel_seed", "param_is_tp_duplicate", "set_tensor_model_parallel_attributes",
]
