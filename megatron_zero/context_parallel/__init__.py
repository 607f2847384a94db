"""Context parallelism: a sequence split over CP ranks in 2 * CP chunks with Megatron's causal load
balancing (`chunks.py`), and attention over the split sequence by ring exchange of K/V (`ring_attention.py`)
or all-gather of K/V (`all_gather_attention.py`), both built on `block_attention.py`, or by DeepSpeed-Ulysses'
all-to-all of heads and sequence (`ulysses_attention.py`), which runs model/attention_core.py's backends.
The names below load on first use (the flags' checks read comm_types.py before torch is loaded)."""
from ..lazy_exports import lazy_exports

_EXPORTS = {"cp_positions": ".chunks", "slice_batch_for_cp": ".chunks", "slice_sequence_for_cp": ".chunks",
            "CP_COMM_TYPES": ".comm_types", "context_parallel_attention": ".attention"}
__all__ = list(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
