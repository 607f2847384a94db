"""Which transformer blocks hold an MoE layer: Megatron-LM's --moe-layer-freq in both its forms.

    --moe-layer-freq 2                 every 2nd block from block 0 (0, 2, 4, ...): an interval
    --moe-layer-freq "[0]*3+[1]*58"    one entry per block, 1 an MoE layer (DeepSeek-V3's three dense blocks first);
                                       Megatron-LM evaluates the expression; here a small safe reader takes list
                                       literals of 0 / 1, `[x]*n`, `+` and parentheses, nothing else

`placement(freq, num_layers)` gives the model's field: a pattern that is every N-th block from one offset becomes
that interval and offset (so checkpoints, converters and Megatron-DeepSpeed's --expert-interval see one form),
any other pattern stays a tuple of 0 / 1, one per block.
"""
from __future__ import annotations

import argparse
import ast
from typing import Tuple, Union

Freq = Union[int, Tuple[int, ...]]


def _value(node):
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_value(e) for e in node.elts]
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Add) and isinstance(left, list) and isinstance(right, list):
            return left + right
        if isinstance(node.op, ast.Mult) and isinstance(left, list) != isinstance(right, list):
            return left * right
    raise ValueError(ast.dump(node))


def parse_moe_layer_freq(text: str) -> Freq:
    """--moe-layer-freq's value: an interval (int) or a per-block pattern (tuple of 0 / 1)."""
    try:
        value = _value(ast.parse(str(text).strip(), mode="eval").body)
    except (SyntaxError, ValueError):
        value = None
    if isinstance(value, int):
        return value
    if isinstance(value, list) and value and all(v in (0, 1) and type(v) is int for v in value):
        return tuple(value)
    raise argparse.ArgumentTypeError(f"{text!r} is neither an interval N nor a list of 0 / 1 per layer "
                                     "(e.g. 2, or \"[0]*3+[1]*58\")")


def placement(freq: Freq, num_layers: int) -> Tuple[Freq, int]:
    """(moe_layer_freq, moe_layer_offset) of the model for --moe-layer-freq's value (ValueError naming what is wrong)."""
    if isinstance(freq, int):
        if freq < 1:
            raise ValueError(f"--moe-layer-freq {freq} must be at least 1")
        return freq, 0
    pattern = list(freq)
    if len(pattern) != num_layers:
        raise ValueError(f"--moe-layer-freq has {len(pattern)} entries for --num-layers {num_layers}; give one per layer")
    if not any(pattern):
        raise ValueError("--moe-layer-freq's pattern has no MoE layer (no 1); drop --num-experts for a dense model")
    for interval in range(1, num_layers + 1):
        for offset in range(interval):
            if pattern == [int(i % interval == offset) for i in range(num_layers)]:
                return interval, offset
    return tuple(pattern), 0


def is_moe_block(freq: Freq, offset: int, block: int) -> bool:
    if isinstance(freq, tuple):
        return block < len(freq) and freq[block] == 1
    return block % freq == offset


def as_pattern(freq: Freq, offset: int, num_layers: int) -> list:
    """The placement as Megatron-LM's list (1: an MoE layer), one entry per block."""
    return [int(is_moe_block(freq, offset, b)) for b in range(num_layers)]
