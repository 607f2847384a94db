"""The conversions tools/convert_checkpoint.py makes, each reading one tensor (or one layer) at a time from a
per-parameter source and writing it out: the universal checkpoint is the hub.

    open_any(fmt, path, **model) -> (files, config, head)   # deepspeed | universal | torch_dist | megatron_legacy | dcp
    convert(src_fmt, dst_fmt, src, out, **options) -> summary

Sources: a ZeRO checkpoint at any layout (ReshapedFiles), a universal one (UniversalFiles), Megatron-Core
torch_dist (TorchDistFiles), Megatron-LM legacy (LegacyFiles), a torchtitan Llama DCP step directory
(TitanFiles; it records no args, so sizes come from its shapes and the head count from `num_attention_heads`).
Sinks: universal (to_universal.write_universal), torch_dist (torch_dist_write), dcp (titan.write_titan).
"""
from __future__ import annotations

import os
import time
from typing import Optional

from ...model.config import GPTConfig
from ..errors import CheckpointError
from ..format import UNIVERSAL_CHECKPOINT_INFO
from .dcp_reader import DcpReader
from .megatron_layout import LEGACY, TORCH_DIST, find_megatron_checkpoint
from .torch_dist import TorchDistFiles, megatron_head, read_common

SOURCES = ("deepspeed", "universal", "torch_dist", "megatron_legacy", "dcp")
SINKS = ("universal", "torch_dist", "dcp")


def titan_config(directory: str, num_attention_heads: Optional[int], seq_length: int, rotary_base: float,
                 norm_epsilon: float, make_vocab_size_divisible_by: int) -> GPTConfig:
    if not num_attention_heads:
        raise CheckpointError(f"a torchtitan checkpoint ({directory}) records no head count; pass "
                              "--num-attention-heads")
    r = DcpReader(directory)
    emb = r.shape("tok_embeddings.weight")
    if emb is None:
        raise CheckpointError(f"{directory} holds no tok_embeddings.weight: it is not a torchtitan Llama checkpoint")
    layers = sum(1 for k in r.tensors if k.startswith("layers.") and k.endswith(".attention_norm.weight"))
    wk = r.shape("layers.0.attention.qkv_linear.wk.weight") or r.shape("layers.0.attention.wk.weight")
    head_dim = emb[1] // num_attention_heads
    return GPTConfig(vocab_size=emb[0], hidden_size=emb[1], num_layers=layers, num_attention_heads=num_attention_heads,
                     num_query_groups=wk[0] // head_dim, ffn_hidden_size=r.shape("layers.0.feed_forward.w1.weight")[0],
                     seq_length=seq_length, max_position_embeddings=seq_length, normalization="RMSNorm",
                     position_embedding_type="rope", swiglu=True, add_bias_linear=False, rotary_base=rotary_base,
                     layernorm_epsilon=norm_epsilon, make_vocab_size_divisible_by=make_vocab_size_divisible_by,
                     untie_embeddings_and_output_weights=r.shape("lm_head.weight") is not None
                     or r.shape("output.weight") is not None)


def config_args(config: GPTConfig) -> dict:
    """Our flags' dests describing `config`, as a checkpoint header records them."""
    fields = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "seq_length",
              "max_position_embeddings", "make_vocab_size_divisible_by", "normalization", "apply_layernorm_1p",
              "position_embedding_type",
              "swiglu", "num_query_groups", "untie_embeddings_and_output_weights", "add_bias_linear", "rotary_base",
              "rotary_percent", "layernorm_epsilon")
    return {f: getattr(config, f) for f in fields}


def open_any(fmt: str, path: str, vocab_size: Optional[int] = None, **titan):
    """(per-parameter source, model config, header) of a checkpoint in format `fmt`."""
    if fmt in ("deepspeed", "universal"):
        from .torch_dist_write import open_source, source_config
        files, head = open_source(path)
        config, _ = source_config(head, path)
        return files, config, head
    if fmt in ("torch_dist", "megatron_legacy"):
        found = find_megatron_checkpoint(path)
        want = TORCH_DIST if fmt == "torch_dist" else LEGACY
        if found is None or found[1] != want:
            raise CheckpointError(f"{path} is not a Megatron-LM {want} checkpoint (an iter_XXXXXXX directory, or a "
                                  "save directory whose latest_checkpointed_iteration.txt names one)")
        from .to_universal import config_from_common
        directory = found[0]
        if fmt == "torch_dist":
            common = read_common(directory)
            config, args = config_from_common(common, vocab_size, directory)
            files = TorchDistFiles(directory, config)
            head = megatron_head(common, files.has_optimizer)
        else:
            from .megatron_legacy import LegacyFiles, legacy_files
            from ..storage.safe_pickle import safe_load
            first = safe_load(legacy_files(directory)[(0, 0)], mmap=True, where=directory)
            config, args = config_from_common(first, vocab_size, directory)
            files = LegacyFiles(directory, config)
            head = files.head
        head[UNIVERSAL_CHECKPOINT_INFO] = {"original_vocab_size": config.vocab_size,
                                           "padded_vocab_size": args.get("padded_vocab_size")}
        return files, config, head
    if fmt == "dcp":
        from .titan import TitanFiles
        config = titan_config(path, **titan)
        files = TitanFiles(path, config)
        head = files.model_states(0)
        head["args"] = config_args(config)
        head[UNIVERSAL_CHECKPOINT_INFO] = {"original_vocab_size": config.vocab_size}
        return files, config, head
    raise CheckpointError(f"--from {fmt} is not a format this tool reads; it reads {', '.join(SOURCES)}")


def convert(src_fmt: str, dst_fmt: str, src: str, out: str, vocab_size: Optional[int] = None, target_tp: int = 1,
            **titan) -> dict:
    if dst_fmt not in SINKS:
        raise CheckpointError(f"--to {dst_fmt} is not a format this tool writes; it writes {', '.join(SINKS)} "
                              "(Hugging Face: tools/convert_to_hf.py from a universal or ZeRO checkpoint)")
    if dst_fmt == "torch_dist" and src_fmt in ("deepspeed", "universal"):
        from .torch_dist_write import write_torch_dist
        return write_torch_dist(src, out, target_tp)
    start = time.monotonic()
    files, config, head = open_any(src_fmt, src, vocab_size, **titan)
    if dst_fmt == "universal":
        from .to_universal import write_universal
        return write_universal(files, config, head, out, src)
    if dst_fmt == "dcp":
        from .titan import write_titan
        iteration = int(head.get("iteration", 0) or 0)
        directory = os.path.join(out, f"step-{iteration}")
        if os.path.exists(directory):
            raise CheckpointError(f"{directory} already exists; choose another --output or remove it")
        n = write_titan(files, config, directory, iteration)
        files.close()
        return {"params": n, "iteration": iteration, "directory": directory, "seconds": time.monotonic() - start,
                "bytes": sum(os.path.getsize(os.path.join(directory, f)) for f in os.listdir(directory))}
    raise CheckpointError(f"--from {src_fmt} --to torch_dist is not made directly; convert to universal first, "
                          "then --from universal --to torch_dist")
