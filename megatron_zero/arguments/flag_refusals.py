"""Megatron-LM and Megatron-DeepSpeed flags that pretrain_gpt.py refuses, each with its reason: the one table.

`refusals(argv)` reads a command line before argparse does and returns one sentence per refused
flag (all of them together), plus the command line with those flags and their values removed, so
the parser sees only what it knows. A flag listed with a condition is refused only when the
condition holds (e.g. `--optimizer` sgd); otherwise the parser handles it.
docs/coming_from_megatron.md shows this table; a test holds the two equal.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

from .megatron_unsupported import UNSUPPORTED

Given = Dict[str, Optional[str]]  # flag -> its value as written (None for a switch), last one wins


@dataclass(frozen=True)
class Refusal:
    reason: str
    when: Optional[Callable[[Optional[str], Given], bool]] = None  # None: always refused
    condition: str = ""  # the condition in words, for the documentation


REFUSED: Dict[str, Refusal] = {
    # FP8 (docs/fp8.md): torchao's float8 training, which --fp8-format turns on
    "--fp8-recipe": Refusal(
        "FP8 here scales delayed, tensorwise, rowwise or rowwise_with_gw_hp; torchao has no mxfp8 or blockwise "
        "training outside its prototypes (the closest: rowwise)",
        lambda v, g: v in ("mxfp8", "blockwise"), "mxfp8, blockwise"),
    # checkpoint format
    "--ckpt-format": Refusal(
        "megatron_zero loads Megatron-LM's torch_dist and torch (legacy) checkpoints and saves DeepSpeed's layout "
        "(tools/convert_checkpoint.py --to torch_dist converts a save); other formats are not available in this build",
        lambda v, g: v not in ("torch", "torch_dist"), "other than torch, torch_dist"),
    # mixture of experts
    "--moe-router-dtype": Refusal("the router's GEMM runs in the model dtype or fp32 here (--moe-router-dtype fp32)",
                                  lambda v, g: v == "fp64", "fp64"),
    # model
    "--optimizer": Refusal("Adam/AdamW and Muon are available in this build, not SGD", lambda v, g: v == "sgd", "sgd"),
    "--dataloader-type": Refusal("the sampler here is Megatron-LM's single: each global batch is the next samples "
                                 "of the shuffled dataset, resumed exactly", lambda v, g: v != "single",
                                 "other than single"),
    # Megatron-LM's pretraining flags this build does not have (megatron_unsupported.py)
    **{flag: Refusal(reason) for flag, reason in UNSUPPORTED.items()},
}


def _flag_name(token: str) -> Optional[str]:
    if not token.startswith("--") or token == "--":
        return None
    return token.split("=", 1)[0]


def _scan(argv: List[str]) -> List[Tuple[str, int, int, Optional[str]]]:
    """(flag, start, end, value) per `--flag` of argv: tokens [start, end) are the flag and its values."""
    found, i = [], 0
    while i < len(argv):
        name = _flag_name(argv[i])
        if name is None:
            i += 1
            continue
        j = i + 1
        if "=" in argv[i]:
            value = argv[i].split("=", 1)[1]
        else:
            while j < len(argv) and _flag_name(argv[j]) is None:
                j += 1
            value = " ".join(argv[i + 1:j]) if j > i + 1 else None
        found.append((name, i, j, value))
        i = j
    return found


def refusals(argv: List[str]) -> Tuple[List[str], List[str]]:
    """(one sentence per refused flag, argv without the refused flags and their values)."""
    found = _scan(argv)
    given: Given = {name: value for name, _, _, value in found}
    sentences, drop = [], set()
    for name, start, end, value in found:
        rule = REFUSED.get(name)
        if rule is None or (rule.when is not None and not rule.when(value, given)):
            continue
        drop.update(range(start, end))
        shown = name if value is None else f"{name} {value}"
        sentence = f"{shown} is refused: {rule.reason}."
        if sentence not in sentences:
            sentences.append(sentence)
    return sentences, [token for k, token in enumerate(argv) if k not in drop]


def unknown_flag_sentence(flag: str) -> str:
    return (f"{flag} is not a flag of megatron_zero's pretrain_gpt.py (see --help, and "
            "docs/coming_from_megatron.md for the Megatron-LM / Megatron-DeepSpeed flags it takes).")
