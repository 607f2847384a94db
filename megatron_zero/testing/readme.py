"""The README's command blocks, as the tests read and run them: the fenced blocks, split into commands; each
command's program (a script, a tool, pretrain_gpt.py's flags); and a fresh copy of the tree to run them in.

    blocks = command_blocks(open("README.md").read())     # [[command, ...], ...] (continuations joined)
    program(shlex.split(command))                          # ("script", "scripts/demo.sh", [args]) ...
    tree = fresh_tree(tmp_path)                            # the tracked and untracked files, a .venv that is
                                                           # this interpreter, as scripts/setup_env.sh left it
"""
from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from typing import List, Optional, Tuple

from .launch import ROOT

FENCE = re.compile(r"^```[a-z]*\n(.*?)^```$", re.M | re.S)


def command_blocks(readme: str) -> List[List[str]]:
    """Every fenced block's commands: backslash continuations joined, a command that goes on inside an open
    quote joined with its next line, blank lines dropped."""
    blocks = []
    for body in FENCE.findall(readme):
        commands, pending = [], ""
        for line in body.replace("\\\n", " ").splitlines():
            pending = f"{pending}\n{line}" if pending else line
            try:
                shlex.split(pending, comments=True)
            except ValueError:  # an open quote: the command goes on
                continue
            if pending.strip():
                commands.append(pending)
            pending = ""
        assert not pending, f"unterminated command in a README block: {pending!r}"
        blocks.append(commands)
    return blocks


def program(words: List[str]) -> Tuple[str, Optional[str], List[str]]:
    """(kind, path relative to the root, its arguments) of one command's words: kind is 'script' (bash X.sh),
    'tool' (python tools/X.py), 'python-c' or 'other'. Leading VAR=value words are skipped."""
    while words and re.match(r"^[A-Z_]+=", words[0]):
        words = words[1:]
    if len(words) >= 2 and words[0] == "bash":
        return "script", words[1], words[2:]
    if len(words) >= 2 and words[0].endswith("/python"):
        if words[1] == "-c":
            return "python-c", None, words[2:]
        return "tool", words[1], words[2:]
    return "other", None, words


def _stamp_hash(tree: str) -> str:
    """What scripts/setup_env.sh records after installing requirements.txt (its own command, run in `tree`)."""
    return subprocess.run(["bash", "-c", 'cat requirements.txt requirements.txt setup.py $(find csrc -type f '
                           '2>/dev/null | sort) 2>/dev/null | sha256sum | cut -d" " -f1'], cwd=tree, check=True,
                          capture_output=True, text=True).stdout.strip()


def fresh_tree(tmp) -> str:
    """A copy of the checkout's tracked and not-ignored files (what a clone holds, with the work in progress);
    its .venv/bin/python runs this interpreter, stamped as scripts/setup_env.sh stamps an installed venv, so
    the scripts start at once and never install into the real environment."""
    tree = os.path.join(str(tmp), "tree")
    listed = subprocess.run(["git", "ls-files", "-z", "-co", "--exclude-standard"], cwd=ROOT, check=True,
                            capture_output=True).stdout.decode().split("\0")
    for rel in filter(None, listed):
        src = os.path.join(ROOT, rel)
        if os.path.isfile(src):
            os.makedirs(os.path.dirname(os.path.join(tree, rel)), exist_ok=True)
            shutil.copy2(src, os.path.join(tree, rel))
    bin_dir = os.path.join(tree, ".venv", "bin")
    os.makedirs(bin_dir)
    with open(os.path.join(bin_dir, "python"), "w") as f:
        f.write(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} "$@"\n')
    os.chmod(os.path.join(bin_dir, "python"), 0o755)
    with open(os.path.join(tree, ".venv", ".megatron_zero_installed.requirements"), "w") as f:
        f.write(_stamp_hash(tree) + "\n")
    return tree
