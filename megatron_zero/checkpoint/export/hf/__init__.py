"""Hugging Face architectures we import and export: a registry of one module per architecture.

An architecture module (see gpt2.py) provides

    HF_ARCHITECTURE            the transformers class name in config.json's "architectures"
    MODEL_TYPE                 config.json's "model_type"
    SKIPPED_HF                 regexes of HF tensor names that are not parameters (buffers, tied copies)
    PRESERVED_HF               config.json keys our config does not hold, carried from an import to its export
    config_from_hf(hf) -> GPTConfig              refuses (CheckpointError) what our model cannot compute
    hf_config(config) -> dict                    config.json for an export
    flags(config) -> list[str]                   the Megatron flags that build this model
    matches(config) -> bool                      whether an export of `config` is this architecture
    tensor_mappings(config) -> list[TensorMapping]   one per parameter of ours, in our model order, and one per
                                                     persistent buffer the HF model holds too (the expert bias)
    config_for_files(config, hf, names) -> GPTConfig   optional: what the HF files decide (DeepSeek's MTP depths)
    FP32_HF                    optional: regexes of HF tensors an export keeps in fp32 whatever its --dtype

Tensors are in our full form (model/sharding.py): unsharded, the unpadded vocabulary, the fused QKV in
Megatron's grouped layout (per query group: its q heads, then k, then v), the fused SwiGLU weight as
[gate; up]. Adding an architecture is one module and one line in ARCHITECTURES; put more specific
architectures before less specific ones (export takes the first whose `matches` is true).
Errors are CheckpointError, one sentence naming the file or value. Helpers for mappings: mapping.py
(`same`, `transposed`, `base_flags`). The streaming around them: reader.py (HF files, one tensor at a
time), importer.py (-> a weights-only universal checkpoint), exporter.py (-> safetensors shards).
Export builds the config from the checkpoint's recorded args (saved_config.py), so an architecture's
config fields must be GPTConfig fields named like their flags' dests. `mappings_for` is what both
directions use: the module's mappings, with the norm weights of a zero-centred model (--apply-layernorm-1p:
we hold w, Hugging Face the gamma 1 + w) converted.
"""
from __future__ import annotations

from types import ModuleType
from typing import Optional

from ....model.config import GPTConfig
from ...errors import CheckpointError
from . import deepseek_v3, gpt2, llama, mistral, mixtral, qwen2_moe, qwen3, qwen3_moe
from ....model.params import is_norm_weight
from .mapping import TensorMapping, zero_centred

ARCHITECTURES = {m.HF_ARCHITECTURE: m for m in (deepseek_v3, qwen3_moe, mixtral, qwen2_moe, qwen3, llama, mistral, gpt2)}


def for_hf_config(hf: dict, where: str = "config.json") -> ModuleType:
    """The module for a Hugging Face config.json (by "architectures", else by "model_type")."""
    names = list(hf.get("architectures") or [])
    for name in names:
        if name in ARCHITECTURES:
            return ARCHITECTURES[name]
    for module in ARCHITECTURES.values():
        if hf.get("model_type") == module.MODEL_TYPE and not names:
            return module
    raise CheckpointError(f"{where} is a {', '.join(names) or hf.get('model_type', 'unknown model')}; "
                          f"supported: {', '.join(ARCHITECTURES)}")


def for_config(config: GPTConfig, name: Optional[str] = None) -> ModuleType:
    """The module an export of `config` uses: `name` if given, else the first that matches."""
    if config.multi_latent_attention:  # only DeepSeek-V3's class has it (the others would match its other switches)
        problem = deepseek_v3.unsupported_export(config)
        if problem is not None:
            raise CheckpointError(f"this checkpoint's model has multi-latent attention with {problem}, which "
                                  f"{deepseek_v3.HF_ARCHITECTURE}, the Hugging Face model with it, cannot hold")
        if name not in (None, deepseek_v3.HF_ARCHITECTURE):
            raise CheckpointError(f"--architecture {name} cannot hold this checkpoint's model (multi-latent attention: "
                                  f"{deepseek_v3.HF_ARCHITECTURE})")
        return deepseek_v3
    if name is not None:
        if name not in ARCHITECTURES:
            raise CheckpointError(f"--architecture {name} is unknown; choose one of {', '.join(ARCHITECTURES)}")
        if not ARCHITECTURES[name].matches(config):
            raise CheckpointError(f"--architecture {name} cannot hold this checkpoint's model")
        return ARCHITECTURES[name]
    for module in ARCHITECTURES.values():
        if module.matches(config):
            return module
    raise CheckpointError(f"no Hugging Face architecture holds this model; supported: {', '.join(ARCHITECTURES)}")


def mappings_for(module: ModuleType, config: GPTConfig) -> dict:
    """Our parameter name -> its TensorMapping, for `config` (norm weights converted when zero-centred)."""
    out = {}
    for m in module.tensor_mappings(config):
        out[m.ours] = zero_centred(m) if config.apply_layernorm_1p and is_norm_weight(m.ours, config) else m
    return out


__all__ = ["ARCHITECTURES", "TensorMapping", "for_config", "for_hf_config", "mappings_for"]
