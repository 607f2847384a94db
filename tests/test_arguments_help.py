"""`pretrain_gpt.py --help` documents every flag: what it does, and the default of each flag that takes a value."""
import re
import subprocess
import sys
from pathlib import Path

from megatron_zero.arguments import build_parser

ROOT = Path(__file__).resolve().parents[1]


def test_every_flag_has_help():
    """Every flag of the parser, also those a feature's flags module declares (config/moe_deepspeed.py, compat_flags.py, ...)."""
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
