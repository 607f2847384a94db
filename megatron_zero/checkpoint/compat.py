"""Does a checkpoint hold the model the flags describe? Checked before anything is loaded.

The model settings a checkpoint records (its `args`, and the vocabulary in
`universal_checkpoint_info`) are compared with this run's; every disagreement is
named in one sentence and the run refused, because loading the weights into
another architecture either fails later with a shape error or, worse, trains a
different model (another head count, layer-norm epsilon or sequence length gives
normal-looking losses).

    refused when they differ     num_layers, hidden_size, num_attention_heads, ffn_hidden_size,
                                 max_position_embeddings, make_vocab_size_divisible_by,
                                 layernorm_epsilon, the vocabulary size, and the architecture
                                 switches (normalization, position embedding type, rotary base and
                                 percent, swiglu, query groups, untied output, linear biases); the
                                 checkpoint's args and this run's flags each become a typed
                                 model/architecture.ModelSettings (by model_settings, which takes each writer's
                                 spelling and fills what a writer leaves implied (a switch an earlier
                                 version or Megatron(-DeepSpeed) does not record: its GPT-2 value)),
                                 compared field by field;
                                 MoE layers: the number of experts (none: dense), and where both are
                                 MoE the layer frequency and offset and the experts' width
                                 (model/architecture.py's moe_settings)
    free to change on resume     seq_length (up to max_position_embeddings, as in Megatron), parallel
                                 sizes and ZeRO stage (reshaped on load), batch sizes, lr and its schedule, precision, dropout, init std, seed, data,
                                 the MoE router's top-k and gating,
                                 iteration counts, logging and checkpoint flags
"""
from __future__ import annotations

import os
import re
from typing import Optional, Union

from ..model.architecture import MOE_STRUCTURE, SIZES, SWITCHES, ModelSettings
from .errors import CheckpointError
from .format import UNIVERSAL_CHECKPOINT_INFO, header_args
from .storage.reader import Checkpoint, open_directory

HEAD_FILE = re.compile(r"^(?:(?:bf16_|fp16_)?zero_pp_rank_\d+_)?mp_rank_00_model_states\.pt$")


def read_head(checkpoint: Union[str, Checkpoint], verify: bool = True) -> dict:
    """The first model-states file of a checkpoint (or universal checkpoint) directory, or of one opened
    already, checksum-verified where the directory has a manifest (verify=False: not)."""
    directory = checkpoint.directory if isinstance(checkpoint, Checkpoint) else checkpoint
    names = sorted(n for n in os.listdir(directory) if HEAD_FILE.match(n))
    if not names:
        from .interop.megatron_header import megatron_checkpoint_head  # Megatron-LM's checkpoints: their args
        head = megatron_checkpoint_head(directory)
        if head is not None:
            return head
        raise CheckpointError(f"the checkpoint {directory} has no mp_rank_00 model-states file, so the model it "
                              "holds cannot be checked")
    files = checkpoint if isinstance(checkpoint, Checkpoint) else open_directory(directory, verify)
    head = files.load(names[0])
    return head if isinstance(head, dict) else {}


def _same(a, b) -> bool:
    if isinstance(a, str) and isinstance(b, str):
        return a.lower() == b.lower()
    if isinstance(a, float) or isinstance(b, float):
        return a is not None and b is not None and abs(float(a) - float(b)) <= 1e-12 * max(abs(a), abs(b), 1e-30)
    return a == b


def _recorded_vocab(head: dict, saved: dict, padded_at) -> Optional[tuple]:
    """(the checkpoint's vocabulary, ours) in comparable terms, or None if it records none."""
    info = head.get(UNIVERSAL_CHECKPOINT_INFO)
    if isinstance(info, dict) and info.get("original_vocab_size") is not None:
        return int(info["original_vocab_size"]), None
    if saved.get("padded_vocab_size") is not None:  # Megatron: padded at the source's TP
        return int(saved["padded_vocab_size"]), padded_at(int(saved.get("tensor_model_parallel_size", 1) or 1))
    return None


def disagreements(head: dict, args, vocab_size: int, padded_at) -> list:
    """'name checkpoint-value vs here-value' for every model setting that differs."""
    saved = header_args(head)
    there, here = ModelSettings.from_args(saved), ModelSettings.from_args(args)  # both sides by the same rules
    out = []
    for key in SIZES:
        a, b = getattr(there, key), getattr(here, key)
        if a is not None and b is not None and not _same(a, b):
            out.append(f"--{key.replace('_', '-')} {a} in the checkpoint vs {b} here")
    for key in SWITCHES:
        if not _same(getattr(there, key), getattr(here, key)):
            out.append(f"{key} {getattr(there, key)} in the checkpoint vs {getattr(here, key)} here")
    if not _same(there.num_experts, here.num_experts):
        def experts(n):
            return f"{n}" if n is not None else "None (no MoE layers)"
        out.append(f"--num-experts {experts(there.num_experts)} in the checkpoint vs {experts(here.num_experts)} here")
    else:
        for key in MOE_STRUCTURE:
            a, b = getattr(there, key), getattr(here, key)
            if a is not None and b is not None and not _same(a, b):
                out.append(f"--{key.replace('_', '-')} {a} in the checkpoint vs {b} here")
    vocab = _recorded_vocab(head, saved, padded_at)
    if vocab is not None:
        recorded, mine = vocab
        mine = vocab_size if mine is None else mine
        if recorded != mine:
            what = "vocabulary size" if vocab[1] is None else "padded vocabulary size"
            out.append(f"{what} {recorded} in the checkpoint vs {mine} here (from the tokenizer)")
    return out


def check_checkpoint_compat(checkpoint: Union[str, Checkpoint], args, vocab_size: int, padded_at,
                            verify: bool = True) -> dict:
    """Refuse, in one sentence naming each difference, a checkpoint (a directory, or one opened already)
    holding another model than the flags' (`args`: this run's, as a checkpoint records them: config.flat).

    padded_at(tp) is this run's padded vocabulary at tensor-parallel size tp; `verify`: --verify-checkpoint.
    -> the header it read."""
    head = read_head(checkpoint, verify)
    diffs = disagreements(head, args, vocab_size, padded_at)
    directory = checkpoint.directory if isinstance(checkpoint, Checkpoint) else checkpoint
    if diffs:
        raise CheckpointError(f"the checkpoint {directory} holds another model than these flags describe "
                              f"({'; '.join(diffs)}); give the checkpoint's settings, or start without --load")
    return head
