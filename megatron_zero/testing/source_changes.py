"""Which source files changed while a test session ran (tests/conftest.py names them in a failing test's report).

The ranks a test starts (run_ranks' forked workers, torchrun, pretrain_gpt.py) import megatron_zero and the
test helpers from disk when they start, while the pytest process keeps what it imported at collection. A file
edited or merged into the tree during the session therefore gives a parity test two versions of the code
(the ranks train one, the reference the other), and its failure looks like a flake of the code under test.
"""
from __future__ import annotations

import os
from typing import Dict, List

SUFFIXES = (".py", ".sh", ".json", ".args", ".txt")


def snapshot(*roots: str) -> Dict[str, int]:
    """{path: mtime in ns} of the source files under `roots` (folders, or files themselves)."""
    found = {}
    for root in roots:
        if os.path.isfile(root):
            found[root] = os.stat(root).st_mtime_ns
        for folder, dirs, files in os.walk(root):
            dirs[:] = [d for d in dirs if not d.startswith(".") and d != "__pycache__"]
            for name in files:
                if name.endswith(SUFFIXES):
                    path = os.path.join(folder, name)
                    try:
                        found[path] = os.stat(path).st_mtime_ns
                    except FileNotFoundError:  # removed between the listing and the stat
                        pass
    return found


def changed_since(before: Dict[str, int], *roots: str) -> List[str]:
    """The files under `roots` added, removed or modified since `before` (a snapshot of the same roots)."""
    now = snapshot(*roots)
    return sorted(p for p in set(before) | set(now) if before.get(p) != now.get(p))
