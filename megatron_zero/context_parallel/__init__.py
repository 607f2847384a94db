"""Context parallelism: a sequence split over CP ranks in 2 * CP chunks with Megatron's causal load
balancing (`chunks.py`), and attention over the split sequence by ring exchange of K/V (`ring_attention.py`)
or all-gather of K/V (`all_gather_attention.py`), both built on `block_attention.py`, or by DeepSpeed-Ulysses'
all-to-all of heads and sequence (`ulysses_attention.py`), which runs model/attention_core.py's backends."""
from .chunks import cp_positions, slice_batch_for_cp, slice_sequence_for_cp
from .attention import CP_COMM_TYPES, context_parallel_attention

__all__ = ["CP_COMM_TYPES", "context_parallel_attention", "cp_positions", "slice_batch_for_cp",
           "slice_sequence_for_cp"]
