"""`pretrain_gpt.py --help` documents every flag: what it does, and the default of each flag that takes a value."""
import ast
import json
import re
import subprocess
import sys
from pathlib import Path

from megatron_zero.arguments import build_parser

ROOT = Path(__file__).resolve().parents[1]


def test_every_flag_has_help():
    """Every flag of the parser, also those a feature's flags module declares (config/compat.py, config/fp8.py, ...)."""
    parser = build_parser()
    flags = [action for action in parser._actions if action.option_strings]
    undocumented = sorted(a.option_strings[0] for a in flags if not (a.help or "").strip())
    assert len(flags) > 150
    assert not undocumented, f"flags without help text: {' '.join(undocumented)}"


def test_help_shows_defaults():
    """As a user reads it: pretrain_gpt.py --help prints each valued flag's default beside its help."""
    out = subprocess.run([sys.executable, "pretrain_gpt.py", "--help"], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    text = re.sub(r"\s+", " ", out.stdout.split("\noptions:", 1)[1])  # the flags' descriptions, not the usage
    for flag, shown in (("--zero-stage", "(default: 1)"), ("--lr-decay-style", "(default: linear)"),
                        ("--seed SEED", "(default: 1234)"), ("--lr LR", "(default: unset)"),
                        ("--split SPLIT", "(default: 969,30,1)")):
        at = text.index(flag)
        assert shown in text[at:at + 300], (flag, text[at:at + 300])
    for flag in ("--save", "--load", "--train-iters", "--expert-tensor-parallel-size", "--exit-signal-handler"):
        line = text[text.index(f" {flag} "):][:200]
        assert re.search(r"[a-z]{3,} [a-z]{3,}", line.split(flag, 1)[1]), line


def _declared(action) -> dict:
    """A flag as argparse holds it: what parsing it does, not its help text (no type: the text, as str)."""
    kind = getattr(action.type, "__name__", "str" if action.type is None else repr(action.type))
    return dict(options=list(action.option_strings), dest=action.dest, action=type(action).__name__,
                default=repr(action.default), type=kind,
                choices=None if action.choices is None else [repr(c) for c in action.choices],
                nargs=action.nargs, const=repr(action.const), required=action.required)


def test_every_flag_parses_as_it_always_has():
    """Each flag pretrain_gpt.py has taken (tests/data/pretrain_gpt_flags.jsonl, one flag a line: its option
    strings, destination, argparse action, default, type, choices, nargs, constant) is still declared the same
    way, whichever module declares it; new flags may join."""
    rows = [json.loads(line) for line in (ROOT / "tests/data/pretrain_gpt_flags.jsonl").read_text().splitlines()]
    now = {tuple(a.option_strings): _declared(a) for a in build_parser()._actions if a.option_strings}
    assert len(rows) == 240
    changed = [(row, now.get(tuple(row["options"]))) for row in rows if now.get(tuple(row["options"])) != row]
    assert not changed, changed[:3]


def test_flags_are_declared_by_typed_fields():
    """pretrain_gpt.py's flags are generated from config/'s section fields (config/fields.py): no argparse
    declaration elsewhere in the package but other programs' own parsers, and no *_flags.py module outside
    config/ (ops/fusion_flags.py holds the fusion switches, not flags)."""
    package = ROOT / "megatron_zero"
    other_programs = {"config/fields.py", "planning/cli.py", "testing/mcore_peer.py",
                      "checkpoint/export/standalone_zero_to_fp32.py"}
    declaring = sorted(str(path.relative_to(package)) for path in package.rglob("*.py")
                       if any(isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                              and node.func.attr == "add_argument" for node in ast.walk(ast.parse(path.read_text())))
                       and str(path.relative_to(package)) not in other_programs)
    assert declaring == []
    assert sorted(str(p.relative_to(package)) for p in package.rglob("*_flags.py")) == ["ops/fusion_flags.py"]
