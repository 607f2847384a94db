"""Tensor parallelism: mappings, parallel layers, vocab-parallel cross-entropy, the RNG tracker. The names below
load on first use (the flags' checks import loss_flags.py before torch is loaded)."""
from ..lazy_exports import lazy_exports

_MAPPINGS = ("all_gather_last_dim_from_tensor_parallel_region", "copy_to_tensor_model_parallel_region",
             "gather_from_sequence_parallel_region", "gather_from_tensor_model_parallel_region",
             "reduce_from_tensor_model_parallel_region", "reduce_scatter_to_sequence_parallel_region",
             "scatter_to_sequence_parallel_region", "scatter_to_tensor_model_parallel_region")
_EXPORTS = {"vocab_parallel_cross_entropy": ".cross_entropy", "ColumnParallelLinear": ".layers",
            "RowParallelLinear": ".layers", "VocabParallelEmbedding": ".layers",
            **{name: ".mappings" for name in _MAPPINGS}, "get_rng_tracker": ".random",
            "model_parallel_seed": ".random", "param_is_tp_duplicate": ".utils",
            "set_tensor_model_parallel_attributes": ".utils"}
__all__ = list(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
