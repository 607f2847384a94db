"""A bad pretrain_gpt.py command line refused before torch loads, as rank 0 would refuse it: one sentence
(one per flag), exit status 2, in well under the seconds importing torch takes on a small machine.

    check_before_launch(torchrun_argv)   # scripts/pretrain_torchrun.sh, before torchrun (which imports torch)

pretrain_gpt.py itself checks its flags before it imports the trainer (its `main`); this is the same check one
step earlier, in the launcher, at the world size torchrun's command line names (`--nnodes` times
`--nproc-per-node`, where both are numbers). Where the world size is not fixed there (an elastic `--nnodes
1:4`, `--nproc-per-node gpu`), the flags are only parsed (unknown, refused or malformed flags) and the ranks
check the rest. Nothing here imports torch: arguments/__init__.py and the configuration it reads import it lazily.
"""
from __future__ import annotations

import os
from typing import List, Optional, Tuple

SCRIPT = "pretrain_gpt.py"


def _option(argv: List[str], *names: str) -> Optional[str]:
    """The value of torchrun's option `names` (`--name value` or `--name=value`) in `argv`, or None."""
    for i, token in enumerate(argv):
        for name in names:
            if token == name and i + 1 < len(argv):
                return argv[i + 1]
            if token.startswith(name + "="):
                return token.split("=", 1)[1]
    return None


def split_torchrun_argv(argv: List[str]) -> Tuple[List[str], Optional[List[str]]]:
    """(torchrun's own options, pretrain_gpt.py's flags), or (argv, None) when the script is another one."""
    for i, token in enumerate(argv):
        if os.path.basename(token) == SCRIPT:
            return argv[:i], argv[i + 1:]
    return argv, None


def world_size(torchrun_options: List[str]) -> Optional[int]:
    """The ranks torchrun starts: --nnodes (default 1) x --nproc-per-node (default 1), or None where either is
    not a fixed number."""
    nodes = _option(torchrun_options, "--nnodes") or "1"
    low, _, high = nodes.partition(":")
    per_node = _option(torchrun_options, "--nproc-per-node", "--nproc_per_node") or "1"
    if not (low.isdigit() and per_node.isdigit()) or (high and high != low):
        return None
    return int(low) * int(per_node)


def check_before_launch(torchrun_argv: List[str]) -> None:
    """Refuse (print rank 0's sentences, SystemExit(2)) a pretrain_gpt.py command line that its ranks would
    refuse; return otherwise (another script, or flags that pass)."""
    options, flags = split_torchrun_argv(torchrun_argv)
    if flags is None:
        return
    from .restart import parse_for_launch

    size = world_size(options)
    if size is not None:
        parse_for_launch(flags, 0, size)
        return
    from ..arguments import parse_command_line
    from ..config.errors import ArgumentError

    try:
        parse_command_line(flags)
    except ArgumentError as err:
        import sys

        for line in str(err).splitlines():
            print(f"pretrain_gpt.py: error: {line}", file=sys.stderr)
        raise SystemExit(2) from None
