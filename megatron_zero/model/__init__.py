"""The GPT model: config, layer indexing, parameter catalogue, TP sharding, the model itself."""
from .config import GPTConfig
from .gpt import GPTModel, reference_model
from .layer_indices import block_layer_index, final_norm_index, lm_head_index, num_pipeline_layers
from .params import param_names, param_spec
from .sharding import gather_state_dicts, pad_vocab, shard_state_dict, unpad_vocab

__all__ = ["GPTConfig", "GPTModel", "reference_model", "block_layer_index", "final_norm_index", "lm_head_index",
           "num_pipeline_layers", "param_names", "param_spec", "gather_state_dicts", "pad_vocab",
           "shard_state_dict", "unpad_vocab"]
