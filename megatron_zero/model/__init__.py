"""The GPT model: config, layer indexing, parameter catalogue, TP sharding, the model itself. The names below
load on first use (the flags' checks import model/config.py before torch is loaded)."""
from ..lazy_exports import lazy_exports

_EXPORTS = {"GPTConfig": ".config", "GPTModel": ".gpt", "reference_model": ".gpt",
            "block_layer_index": ".layer_indices", "final_norm_index": ".layer_indices",
            "lm_head_index": ".layer_indices", "num_pipeline_layers": ".layer_indices", "param_names": ".params",
            "param_spec": ".params", "gather_state_dicts": ".sharding", "pad_vocab": ".sharding",
            "shard_state_dict": ".sharding", "unpad_vocab": ".sharding"}
__all__ = list(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
