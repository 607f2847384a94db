"""pretrain_gpt.py's command line: the parser (Megatron-LM's and Megatron-DeepSpeed's spellings) in front of
the configuration (megatron_zero/config/), which owns every flag's declaration, check and derived values.

Every inconsistency is refused with one sentence naming the flags and values (ArgumentError);
`parse_args` prints that sentence and exits 2, no traceback.
"""
from __future__ import annotations

import argparse
import copy
import sys
import weakref
from typing import List, Optional

from .. import config
from ..config import compat, compat_noops, compile, elastic, fp8, loss, rerun
from ..config.errors import ArgumentError
from ..config.parallel import cp_a2a_size
from .flag_refusals import refusals, unknown_flag_sentence

__all__ = ["ArgumentError", "FEATURES", "args_to_dict", "build_parser", "cp_a2a_size", "explicit_flags",
           "parse_args", "parse_command_line", "validate_args"]

# A feature's own flags module: (declare its flags on the parser, check them once the layout, model and run
# length are checked). Its flags join --help after the core areas'.
FEATURES = ((compat.add_flags, compat.validate_compat), (elastic.add_flags, elastic.check), (loss.add_flags, None),
            (fp8.add_flags, fp8.check), (compile.add_flags, compile.check),
            (rerun.add_flags, rerun.check), (compat_noops.add_flags, compat_noops.check))  # None: no check of its own


class _HelpFormatter(argparse.HelpFormatter):
    """Each optional flag that takes a value shows its default after its help, "unset" for None unless the help
    says what it defaults to; switches (no value) are off unless given."""

    def _get_help_string(self, action):
        text = action.help or ""
        if action.nargs == 0 or action.required or action.default is argparse.SUPPRESS or "%(default)" in text:
            return text
        if action.default is None:
            return text if "default" in text else text + " (default: unset)"
        return text + " (default: %(default)s)"


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, no usage dump
        raise ArgumentError(f"{message} (see --help)")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="pretrain_gpt.py", description="Pretrain a GPT with TP x PP x ZeRO-DP.", allow_abbrev=False,
                formatter_class=_HelpFormatter)
    config.add_flags(p)
    for add_flags, _ in FEATURES:
        add_flags(p)
    return p


def explicit_flags(args) -> set:
    """Destinations whose value differs from the parser's default (given on the command line)."""
    parser = build_parser()
    return {dest for dest, value in vars(args).items() if value != parser.get_default(dest)}


# id(namespace) -> (its flags as parsed, the destinations given, its values as validated): a namespace validated
# again is checked from what was parsed (not from derived values: a list --pipeline-partition, MoE defaults that
# would read as given), with what its holder changed since on top
_AS_PARSED: dict = {}


def validate_args(args, world_size: int):
    """Check the parsed flags for `world_size` ranks and fill the derived values (config.validate). Idempotent:
    validating a namespace again (at this or another world size) gives what validating its command line once
    would, plus the values its holder set since (those count as given)."""
    if id(args) in _AS_PARSED:
        parsed, given, validated = _AS_PARSED[id(args)]
        changed = {k: v for k, v in vars(args).items() if k not in validated or validated[k] != v}
        vars(args).clear()
        vars(args).update(copy.deepcopy(parsed))
        vars(args).update(changed)
        given = given | set(changed)
    else:
        parsed, given = copy.deepcopy(vars(args)), explicit_flags(args)
        weakref.finalize(args, _AS_PARSED.pop, id(args), None)
    config.validate(args, world_size, set(given), [check for _, check in FEATURES if check is not None])
    _AS_PARSED[id(args)] = (parsed, given, copy.deepcopy(vars(args)))
    return args


def parse_args(argv: Optional[List[str]] = None, world_size: int = 1, report: bool = True):
    """Parse and validate; on bad input print one sentence to stderr (if `report`: one rank of many) and exit 2."""
    try:
        return validate_args(parse_command_line(argv), world_size)
    except ArgumentError as err:
        if report:
            for line in str(err).splitlines():
                print(f"pretrain_gpt.py: error: {line}", file=sys.stderr)
        raise SystemExit(2) from None


def parse_command_line(argv: Optional[List[str]] = None):
    """argv -> args namespace; every refused or unknown flag in one ArgumentError, one sentence (line) each."""
    argv = sys.argv[1:] if argv is None else list(argv)
    sentences, kept = refusals(argv)
    parser = build_parser()
    known = parser._option_string_actions  # argparse's table of option strings (stable since Python 2.7)
    sentences += [unknown_flag_sentence(t.split("=", 1)[0]) for t in kept
                  if t.startswith("--") and t.split("=", 1)[0] not in known]
    try:
        args, leftover = parser.parse_known_args(kept)
    except ArgumentError as err:
        raise ArgumentError("\n".join(sentences + [str(err)])) from None
    for k, token in enumerate(leftover):
        if token.startswith("-") and not token.startswith("--"):
            sentences.append(unknown_flag_sentence(token))
        elif not token.startswith("-") and (k == 0 or not leftover[k - 1].startswith("-")):
            sentences.append(f"{token!r} is not the value of any flag (see --help).")
    if sentences:
        raise ArgumentError("\n".join(sentences))
    return args


def args_to_dict(args) -> dict:
    """The arguments as a plain dict (JSON-able values), for checkpoints."""
    return config.plain_values(vars(args))
