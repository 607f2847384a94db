"""The model config a checkpoint was saved with: from its recorded args, sizes it lacks from tensor shapes.

    args = saved_args(checkpoint_dir)                    # the args in mp_rank_*_model_states.pt, or {}
    config = saved_config(names, shape_of, args)         # shape_of(name): a full (unsharded) shape

The args are read in any writer's spelling (model/architecture.py's model_settings, as the resume check
reads them). Our trainer and importer record every model flag; other writers (DeepSpeed, tests) may record none,
so sizes the args lack are read from the full shapes of a GPT-2 (an architecture that needs more must
record its args), and the head count, which no shape shows, must come from the args or `num_heads`.
"""
from __future__ import annotations

import os
from typing import Callable, Optional, Sequence

from ..model.architecture import gpt_config, model_settings
from ..model.config import GPTConfig
from ..model.layer_indices import block_layer_index
from ..model.params import (POSITION_EMBEDDINGS, UNTIED_POSITION_EMBEDDINGS, UNTIED_WORD_EMBEDDINGS,
                            WORD_EMBEDDINGS)
from .errors import CheckpointError
from .format import MODEL_FILE, ZERO3_MODEL_FILE, header_args
from .storage.reader import open_directory


def saved_args(directory: str, verify: bool = True) -> dict:
    """The training arguments a checkpoint directory records (its first model-states file, verified), or {}."""
    heads = [f for f in sorted(os.listdir(directory)) if MODEL_FILE.match(f) or ZERO3_MODEL_FILE.match(f)]
    if not heads:
        return {}
    return header_args(open_directory(directory, verify).load(heads[0]))


def saved_config(names: Sequence[str], shape_of: Callable[[str], Sequence[int]], args: dict,
                 num_heads: Optional[int] = None, where: str = "the checkpoint") -> GPTConfig:
    """Recorded args first; the sizes they lack from the shapes; the vocabulary always from the shapes.
    `names`: every parameter; `shape_of(name)`: a parameter's full shape (asked for at most three)."""
    recorded = {k: v for k, v in {**args, **model_settings(args, fill_sizes=False)}.items() if v is not None}
    if num_heads:
        recorded["num_attention_heads"] = int(num_heads)
    if not recorded.get("num_attention_heads"):
        raise CheckpointError(f"{where} does not record num_attention_heads in its args; pass --num-attention-heads")
    untied = UNTIED_WORD_EMBEDDINGS in names
    word = UNTIED_WORD_EMBEDDINGS if untied else WORD_EMBEDDINGS
    if word not in names:
        raise CheckpointError(f"{where} holds no {WORD_EMBEDDINGS}; it is not a checkpoint of our GPT")
    vocab, hidden = shape_of(word)
    first = f"{block_layer_index(0)}."
    sizes = {"hidden_size": hidden,
             "num_layers": sum(1 for k in names if k.endswith(".self_attention.query_key_value.weight"))}
    if "ffn_hidden_size" not in recorded:  # SwiGLU's rows are [gate; up]
        rows = shape_of(first + "mlp.dense_h_to_4h.weight")[0]
        sizes["ffn_hidden_size"] = rows // 2 if recorded.get("swiglu") else rows
    if "num_query_groups" not in recorded:  # QKV rows: (heads + 2 groups) x head_dim
        heads = recorded["num_attention_heads"]
        qkv_heads = shape_of(first + "self_attention.query_key_value.weight")[0] // (hidden // heads)
        sizes["num_query_groups"] = (qkv_heads - heads) // 2
    positions = UNTIED_POSITION_EMBEDDINGS if untied else POSITION_EMBEDDINGS
    if positions in names and "max_position_embeddings" not in recorded:
        sizes["max_position_embeddings"] = shape_of(positions)[0]
    if "max_position_embeddings" not in {**sizes, **recorded}:
        raise CheckpointError(f"{where} records no max_position_embeddings in its args and has no position "
                              "embedding to read it from (a RoPE model); pass the training run's args")
    if "seq_length" not in recorded:
        sizes["seq_length"] = recorded.get("max_position_embeddings", sizes.get("max_position_embeddings"))
    return gpt_config({**sizes, **recorded, "untie_embeddings_and_output_weights": untied}, vocab)
