"""The conversions tools/convert_checkpoint.py makes, each reading one tensor (or one layer) at a time from a
per-parameter source and writing it out: the universal checkpoint is the hub.

    open_any(fmt, path, **model) -> (files, config, head)   # deepspeed | universal | torch_dist | megatron_legacy | dcp
    convert(src_fmt, dst_fmt, src, out, **options) -> summary   # the pairs in PAIRS; check_pair refuses others

Sources: a ZeRO checkpoint at any layout (ReshapedFiles), a universal one (UniversalFiles), Megatron-Core
torch_dist (TorchDistFiles), Megatron-LM legacy (LegacyFiles), a torchtitan Llama DCP step directory
(TitanFiles; it records no args, so sizes come from its shapes and the head count from `num_attention_heads`).
Sinks: universal (to_universal.write_universal), torch_dist (torch_dist_write), dcp (titan.write_titan); each
streams one tensor at a time and refuses an output that would move a checkpoint pointer back (output_guard.py).
The --input is checked first to be in the format --from names (output_guard.detect_format), so a wrong or empty
directory is one sentence saying what it is, before anything is opened.
"""
from __future__ import annotations

import os
import time
from typing import Optional

import torch

from ...model.config import GPTConfig
from ..errors import CheckpointError
from ..format import UNIVERSAL_CHECKPOINT_INFO
from .dcp_reader import DcpReader
from .megatron_layout import LEGACY, TORCH_DIST, find_megatron_checkpoint
from .torch_dist import TorchDistFiles, read_common

SOURCES = ("deepspeed", "universal", "torch_dist", "megatron_legacy", "dcp")
SINKS = ("universal", "torch_dist", "dcp")
PAIRS = {"universal": ("deepspeed", "torch_dist", "megatron_legacy", "dcp"),  # sink: the sources converted to it
         "torch_dist": ("deepspeed", "universal"),
         "dcp": ("deepspeed", "universal", "torch_dist", "megatron_legacy")}


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


def open_any(fmt: str, path: str, vocab_size: Optional[int] = None, global_batch_size: Optional[int] = None,
             **titan):
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
            head = files.model_states(0)  # Megatron-LM's header, with the routers' expert biases
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
        files = TitanFiles(path, config, global_batch_size)
        head = files.model_states(0)
        head["args"] = config_args(config)
        head[UNIVERSAL_CHECKPOINT_INFO] = {"original_vocab_size": config.vocab_size}
        return files, config, head
    raise CheckpointError(f"--from {fmt} is not a format this tool reads; it reads {', '.join(SOURCES)}")


def pairs_text() -> str:
    """The conversions this tool makes, as --help and its refusals list them."""
    return "; ".join(f"{' | '.join(src)} -> {dst}" for dst, src in PAIRS.items())


def check_pair(src_fmt: str, dst_fmt: str) -> None:
    hf = "Hugging Face models are converted by tools/convert_from_hf.py (into ours) and tools/convert_to_hf.py (out)"
    for flag, fmt, known in (("--from", src_fmt, SOURCES), ("--to", dst_fmt, SINKS)):
        if fmt == "hf":
            raise CheckpointError(f"{flag} hf: {hf}; this tool converts {pairs_text()}")
        if fmt not in known:
            raise CheckpointError(f"{flag} {fmt} is not a format this tool knows; it converts {pairs_text()}")
    if src_fmt not in PAIRS[dst_fmt]:
        raise CheckpointError(f"--from {src_fmt} --to {dst_fmt} is not a conversion this tool makes; it converts "
                              f"{pairs_text()}" + (" (convert to universal first, then from it)"
                                                   if dst_fmt == "torch_dist" else ""))


def check_source(src_fmt: str, src: str) -> None:
    """Refuse a --input that is missing, empty, or in another format than --from says, naming what it is."""
    from .output_guard import detect_format, name_format
    if not os.path.isdir(src):
        raise CheckpointError(f"--input {src} does not exist or is not a directory")
    found = detect_format(src)
    readable = {"deepspeed": ("deepspeed", "universal"), "universal": ("deepspeed", "universal")}.get(src_fmt,
                                                                                                       (src_fmt,))
    if found not in readable:
        raise CheckpointError(f"--input {src} is {name_format(src)}, not what --from {src_fmt} reads"
                              + (f"; pass --from {found}" if found in SOURCES else ""))


def convert(src_fmt: str, dst_fmt: str, src: str, out: str, vocab_size: Optional[int] = None, target_tp: int = 1,
            force: bool = False, progress: bool = False, global_batch_size: Optional[int] = None, **titan) -> dict:
    """Convert; the summary has params, tensors, bytes, seconds, iteration, directory and, where the data position
    had to be found, `consumed` (one sentence saying how)."""
    check_pair(src_fmt, dst_fmt)
    if global_batch_size is not None and src_fmt != "dcp":
        raise CheckpointError(f"--global-batch-size derives the samples consumed of a torchtitan checkpoint (--from "
                              f"dcp); --from {src_fmt} records them")
    check_source(src_fmt, src)
    if dst_fmt == "torch_dist":
        from .torch_dist_write import write_torch_dist
        return write_torch_dist(src, out, target_tp, force=force, progress=progress)
    if src_fmt == "deepspeed" and dst_fmt == "universal":  # tools/ds_to_universal.py's conversion, the same files
        from ..reshape.universal_convert import convert_to_universal
        return convert_to_universal(src, out, progress=progress, force=force)
    start = time.monotonic()
    files, config, head = open_any(src_fmt, src, vocab_size, global_batch_size=global_batch_size, **titan)
    note = {"consumed": files.consumed_note} if src_fmt == "dcp" else {}
    if dst_fmt == "universal":
        from .to_universal import write_universal
        return {**write_universal(files, config, head, out, src, force, progress), **note}
    from ..progress import Progress
    from .output_guard import check_output
    from .titan import titan_chunks, write_titan
    iteration = int(head.get("iteration", 0) or 0)
    directory = os.path.join(out, f"step-{iteration}")
    if os.path.exists(directory):
        raise CheckpointError(f"{directory} already exists; choose another --output or remove it")
    check_output("dcp", out, iteration, force)
    chunks = titan_chunks(config)
    bar = Progress("convert_checkpoint", len(chunks), progress,
                   total_bytes=sum(4 * torch.Size(c.global_size).numel() for *_, c in chunks))
    consumed = int((head.get("train_state") or {}).get("consumed_train_samples", head.get("consumed_train_samples"))
                   or 0)
    try:
        n = write_titan(files, config, directory, iteration, consumed, bar)
    finally:
        bar.close()
        files.close()
    return {"params": n, "iteration": iteration, "directory": directory, "seconds": time.monotonic() - start,
            "tensors": bar.done, "bytes": sum(os.path.getsize(os.path.join(directory, f)) for f in os.listdir(directory)),
            **note}
