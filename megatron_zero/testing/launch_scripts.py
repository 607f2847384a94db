"""The six public launch scripts' pretrain_gpt.py argument lists (tests/data/launch_scripts/), with paths filled in.

Each `<name>.args` holds one argument per line as bash hands them to Python, paths written as
@NAME@; scripts.json records where each came from and the world size it launches.
"""
from __future__ import annotations

import json
import os
from typing import Dict, List

DATA_DIR = os.path.join(os.path.dirname(__file__), "..", "..", "tests", "data", "launch_scripts")


def scripts() -> Dict[str, dict]:
    with open(os.path.join(DATA_DIR, "scripts.json")) as f:
        return {k: v for k, v in json.load(f).items() if not k.startswith("_")}


def script_argv(name: str, paths: Dict[str, str]) -> List[str]:
    """The script's argv with each @NAME@ replaced by paths[NAME] (DS_CONFIG defaults to the script's JSON)."""
    meta = scripts()[name]
    fill = dict(paths)
    if "ds_config" in meta:
        fill.setdefault("DS_CONFIG", os.path.join(DATA_DIR, meta["ds_config"]))
    with open(os.path.join(DATA_DIR, f"{name}.args")) as f:
        argv = f.read().splitlines()
    out = []
    for token in argv:
        for key, value in fill.items():
            token = token.replace(f"@{key}@", value)
        out.append(token)
    return out


def replace_flag(argv: List[str], flag: str, *values: str) -> List[str]:
    """argv with `flag`'s values replaced (the flag keeps its place; `flag=value` spelling too)."""
    out, i = [], 0
    while i < len(argv):
        token = argv[i]
        if token == flag or token.startswith(flag + "="):
            out += [flag, *values]
            i += 1
            if "=" not in token:
                while i < len(argv) and not argv[i].startswith("--"):
                    i += 1
            continue
        out.append(token)
        i += 1
    return out
