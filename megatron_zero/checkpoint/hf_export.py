"""Export our GPT to a Hugging Face `transformers` GPT2LMHeadModel directory (config.json + model.safetensors).

    export_hf(full_state_dict, config, out_dir)                     # from a full-form state dict
    convert_checkpoint_to_hf(checkpoint_dir, out_dir, num_heads=None)  # from any of our checkpoints

GPT-2's pieces map one to one (pre-LayerNorm blocks, tanh GeLU = "gelu_new", learned
positions, tied output head). Differences handled here: HF's Conv1D stores weights
transposed ([in, out]); its fused c_attn output is [q(all heads) | k | v] while ours is per
head ([heads, (q, k, v), head_dim]); the vocabulary is the unpadded one.
"""
from __future__ import annotations

import json
import os
from typing import Dict, Optional

import torch

from ..model.config import GPTConfig
from ..model.layers import block_layer_index, final_norm_index
from ..model.params import POSITION_EMBEDDINGS, WORD_EMBEDDINGS
from .consolidate import get_fp32_state_dict, resolve_checkpoint_dir, write_safetensors
from .errors import CheckpointError
from .reader import open_directory
from .universal_source import MODEL_FILE


def _qkv_to_hf(t: torch.Tensor, heads: int) -> torch.Tensor:
    """Per-head [heads*(q,k,v)*hd, ...] rows -> [q | k | v] rows."""
    rest = t.shape[1:]
    return t.reshape(heads, 3, -1, *rest).transpose(0, 1).reshape(t.shape[0], *rest)


def hf_state_dict(sd: Dict[str, torch.Tensor], config: GPTConfig) -> Dict[str, torch.Tensor]:
    heads, out = config.num_attention_heads, {}
    out["transformer.wte.weight"] = sd[WORD_EMBEDDINGS]
    out["transformer.wpe.weight"] = sd[POSITION_EMBEDDINGS]
    for b in range(config.num_layers):
        i, o = block_layer_index(b), f"transformer.h.{b}."
        g = lambda s: sd[f"{i}.{s}"]  # noqa: E731
        out[o + "ln_1.weight"], out[o + "ln_1.bias"] = g("input_layernorm.weight"), g("input_layernorm.bias")
        out[o + "attn.c_attn.weight"] = _qkv_to_hf(g("self_attention.query_key_value.weight"), heads).t()
        out[o + "attn.c_attn.bias"] = _qkv_to_hf(g("self_attention.query_key_value.bias"), heads)
        out[o + "attn.c_proj.weight"] = g("self_attention.dense.weight").t()
        out[o + "attn.c_proj.bias"] = g("self_attention.dense.bias")
        out[o + "ln_2.weight"] = g("post_attention_layernorm.weight")
        out[o + "ln_2.bias"] = g("post_attention_layernorm.bias")
        out[o + "mlp.c_fc.weight"] = g("mlp.dense_h_to_4h.weight").t()
        out[o + "mlp.c_fc.bias"] = g("mlp.dense_h_to_4h.bias")
        out[o + "mlp.c_proj.weight"] = g("mlp.dense_4h_to_h.weight").t()
        out[o + "mlp.c_proj.bias"] = g("mlp.dense_4h_to_h.bias")
    f = final_norm_index(config.num_layers)
    out["transformer.ln_f.weight"], out["transformer.ln_f.bias"] = sd[f"{f}.weight"], sd[f"{f}.bias"]
    return {k: v.detach().float().contiguous() for k, v in out.items()}


def hf_config(config: GPTConfig) -> dict:
    return {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
        "vocab_size": config.vocab_size, "n_positions": config.max_position_embeddings,
        "n_embd": config.hidden_size, "n_layer": config.num_layers, "n_head": config.num_attention_heads,
        "n_inner": config.ffn_hidden_size, "activation_function": "gelu_new",
        "layer_norm_epsilon": config.layernorm_epsilon, "initializer_range": config.init_method_std,
        "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "scale_attn_weights": True,
        "tie_word_embeddings": True, "torch_dtype": "float32", "bos_token_id": 0, "eos_token_id": 0,
    }


def export_hf(sd: Dict[str, torch.Tensor], config: GPTConfig, out_dir: str) -> str:
    os.makedirs(out_dir, exist_ok=True)
    tensors = hf_state_dict(sd, config)
    write_safetensors(os.path.join(out_dir, "model.safetensors"), list(tensors.items()), {"format": "pt"})
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(hf_config(config), f, indent=2)
    return out_dir


def saved_args(directory: str, verify: bool = True) -> dict:
    """The training arguments a checkpoint directory records (its first model-states file), or {}."""
    heads = [f for f in sorted(os.listdir(directory)) if MODEL_FILE.match(f)]
    if not heads:
        return {}
    args = open_directory(directory, verify).load(heads[0]).get("args") or {}
    return args if isinstance(args, dict) else vars(args)


def config_from_checkpoint(sd: Dict[str, torch.Tensor], directory: str, num_heads: Optional[int] = None,
                           layernorm_epsilon: Optional[float] = None, verify: bool = True) -> GPTConfig:
    """Shapes give every size but the head count, which comes from the checkpoint's args or `num_heads`."""
    args = saved_args(directory, verify)
    num_heads = num_heads or args.get("num_attention_heads")
    if not num_heads:
        raise CheckpointError(f"the checkpoint {directory} does not record num_attention_heads in its args; "
                              "pass --num-attention-heads")
    vocab, hidden = sd[WORD_EMBEDDINGS].shape
    layers = sum(1 for k in sd if k.endswith(".self_attention.query_key_value.weight"))
    ffn = sd[f"{block_layer_index(0)}.mlp.dense_h_to_4h.weight"].shape[0]
    positions = sd[POSITION_EMBEDDINGS].shape[0]
    return GPTConfig(vocab_size=vocab, hidden_size=hidden, num_layers=layers, num_attention_heads=int(num_heads),
                     seq_length=positions, max_position_embeddings=positions, ffn_hidden_size=ffn,
                     layernorm_epsilon=layernorm_epsilon or args.get("layernorm_epsilon", 1e-5))


def convert_checkpoint_to_hf(checkpoint_dir: str, out_dir: str, num_heads: Optional[int] = None,
                             tag: Optional[str] = None, verify: bool = True) -> GPTConfig:
    directory = resolve_checkpoint_dir(checkpoint_dir, tag)
    sd = get_fp32_state_dict(directory, verify=verify)
    config = config_from_checkpoint(sd, directory, num_heads, verify=verify)
    export_hf(sd, config, out_dir)
    return config
