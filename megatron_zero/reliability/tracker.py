"""--result-rejected-tracker-filename: one line per failed check and re-run, in Megatron-LM's format, and the
iterations a start-up skips because of them (Megatron-LM's rule, so either program reads the other's file).

    ts=2026-11-28 10:04:05.123456 node=host3 device=cpu jobID=N/A rank=1 iteration=7 \
        status=RerunValidationStatus.FIRST_RERUN_REPRODUCIBLE result=nan message='...'

An iteration is skipped when one rank has logged it twice with a reproducible status (rerun_disabled,
first_rerun_reproducible, second_rerun_reproducible), unless more than one rank of the same job logged it.
`iteration` is 1-based, the iteration as logged (Megatron-LM's `current_iteration`). Host files only.
"""
from __future__ import annotations

import datetime
import os
import re
from typing import Dict, List, Set, Tuple

INITIAL_RUN = "INITIAL_RUN"
FIRST_RERUN_NOT_REPRODUCIBLE = "FIRST_RERUN_NOT_REPRODUCIBLE"
FIRST_RERUN_REPRODUCIBLE = "FIRST_RERUN_REPRODUCIBLE"
SECOND_RERUN_NOT_REPRODUCIBLE = "SECOND_RERUN_NOT_REPRODUCIBLE"
SECOND_RERUN_REPRODUCIBLE = "SECOND_RERUN_REPRODUCIBLE"
_REPRODUCIBLE = ("RERUN_DISABLED", FIRST_RERUN_REPRODUCIBLE, SECOND_RERUN_REPRODUCIBLE)
_LINE = re.compile(r"ts=.+ node=.+ device=.+ jobID=(.+) rank=(.+) iteration=(.+) status=(.+) result=.+ message=.+")


def tracker_line(rank: int, device: str, iteration: int, status: str, result: float, message: str) -> str:
    """One line of the tracker file (status: one of the names above)."""
    return (f"ts={datetime.datetime.now()} node={os.uname()[1]} device={device} "
            f"jobID={os.getenv('SLURM_JOBID', 'N/A')} rank={rank} iteration={iteration} "
            f"status=RerunValidationStatus.{status} result={result} message='{message}'\n")


def append_lines(path: str, lines: List[str]) -> None:
    with open(path, "a") as f:
        f.write("".join(lines))
        f.flush()
        os.fsync(f.fileno())


def iterations_to_skip(path: str) -> List[int]:
    """The iterations a tracker file shows rejected (an absent file: none)."""
    if not os.path.exists(path):
        return []
    potential: Set[int] = set()
    ignored: Set[int] = set()
    seen: Set[Tuple[int, int]] = set()
    by_job: Dict[str, Dict[int, Set[int]]] = {}
    with open(path) as f:
        for line in f:
            match = _LINE.search(line)
            if not match:
                continue
            job, rank, iteration = match[1], int(match[2]), int(match[3])
            if match[4].split(".")[-1].upper() not in _REPRODUCIBLE:
                continue
            if (rank, iteration) in seen:
                potential.add(iteration)
            seen.add((rank, iteration))
            ranks = by_job.setdefault(job, {}).setdefault(iteration, set())
            ranks.add(rank)
            if len(ranks) > 1:
                ignored.add(iteration)
    return sorted(potential - ignored)
