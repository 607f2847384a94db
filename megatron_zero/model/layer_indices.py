"""Global layer indices, as Megatron-DeepSpeed's GPTModelPipe numbers them (L = num_layers):

    0        input cast (no parameters)
    1        embedding: tied, under `tied_modules.embed.`; untied, under `1.`
    2..L+1   transformer blocks (parameters under `{i}.`)
    L+2      final norm (`{L+2}.weight`, and `{L+2}.bias` for LayerNorm)
    L+3      output head: tied to the word embedding (no parameters of its own), or untied,
             Megatron-DeepSpeed's LMHeadPipe (`{L+3}.lm_head.weight`, on the last stage)
    L+4      the multi-token prediction layers (--mtp-num-layers; `{L+4}.{k}.*`): outside the pipeline's
             partition, held by the stage that holds the output head

Pure functions, usable offline (checkpoint tools, pipeline partitioning).
"""
from __future__ import annotations

INPUT_INDEX = 0
EMBEDDING_INDEX = 1
FIRST_BLOCK_INDEX = 2


def num_pipeline_layers(num_layers: int) -> int:
    return num_layers + 4


def block_layer_index(block_number: int) -> int:
    """Global layer index of transformer block `block_number` (0-based)."""
    return block_number + FIRST_BLOCK_INDEX


def block_number(layer_index: int) -> int:
    return layer_index - FIRST_BLOCK_INDEX


def final_norm_index(num_layers: int) -> int:
    return num_layers + 2


def lm_head_index(num_layers: int) -> int:
    return num_layers + 3


def mtp_index(num_layers: int) -> int:
    """The multi-token prediction block's index: the stage holding the output head holds it too."""
    return num_layers + 4


def is_block_index(layer_index: int, num_layers: int) -> bool:
    return FIRST_BLOCK_INDEX <= layer_index < final_norm_index(num_layers)


def layer_kind(layer_index: int, num_layers: int) -> str:
    """One of 'input', 'embedding', 'block', 'final_norm', 'lm_head', 'mtp'."""
    if layer_index == INPUT_INDEX:
        return "input"
    if layer_index == EMBEDDING_INDEX:
        return "embedding"
    if is_block_index(layer_index, num_layers):
        return "block"
    if layer_index == final_norm_index(num_layers):
        return "final_norm"
    if layer_index == lm_head_index(num_layers):
        return "lm_head"
    if layer_index == mtp_index(num_layers):
        return "mtp"
    raise ValueError(f"layer index {layer_index} lies outside 0..{num_pipeline_layers(num_layers) - 1} "
                     f"for a model of {num_layers} layers")


def holds_embedding(layer_indices, num_layers: int, tied: bool = True) -> bool:
    """A stage keeps the embedding if it runs the input embedding, or, tied, the output head."""
    return EMBEDDING_INDEX in layer_indices or (tied and lm_head_index(num_layers) in layer_indices)
