"""A run that torchrun restarted (--max-restarts), perhaps at another world size (--nnodes MIN:MAX).

    args = parse_for_launch(argv, launch)   # the flags at this world size; refused: the sizes that work
    note_resize(client, parallel, log)      # after a load at another DP: the one line saying what changed

A restart resumes from the newest checkpoint under --load (checkpoint/resume.py; the same rule as any
resume). At another world size TP, PP, CP and EP stay as the flags give them and DP takes the rest; the
checkpoint is reshaped while loading, --global-batch-size is kept by changing the number of micro-batches a
step, and the data order is the uninterrupted run's (each global batch is the same samples, split over
another number of DP ranks).
"""
from __future__ import annotations

import copy
import os
import sys
from typing import List, Optional

from ..arguments import ArgumentError, parse_command_line, validate_args

MAX_SIZES = 8  # world sizes named in a refusal


def restart_count(environ: Optional[dict] = None) -> int:
    """torchrun's TORCHELASTIC_RESTART_COUNT: 0 on the first attempt (and outside torchrun)."""
    env = os.environ if environ is None else environ
    try:
        return int(env.get("TORCHELASTIC_RESTART_COUNT", "0"))
    except ValueError:
        return 0


def _divisors(n: int) -> List[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def world_sizes_that_work(parsed, world_size: int) -> List[int]:
    """The world sizes (other than `world_size`) at which the flags validate: TP x PP x CP times a DP that
    divides --global-batch-size / --micro-batch-size (up to 64 DP sizes without a global batch), each
    checked by validate_args itself, the first MAX_SIZES of them."""
    model = (parsed.tensor_model_parallel_size or 1) * (parsed.pipeline_model_parallel_size or 1) * max(
        1, getattr(parsed, "context_parallel_size", 1) or 1)
    gbs, mb = parsed.global_batch_size, parsed.micro_batch_size
    dps = _divisors(gbs // mb) if gbs and mb and gbs >= mb else list(range(1, 65))
    found = []
    for dp in dps:
        size = model * dp
        if size == world_size:
            continue
        try:
            validate_args(copy.deepcopy(parsed), size)
        except (ArgumentError, SystemExit, ValueError):
            continue
        found.append(size)
        if len(found) == MAX_SIZES:
            break
    return found


def parse_for_launch(argv, rank: int, world_size: int):
    """The validated flags at this world size; refused as parse_args refuses (one sentence from rank 0, exit 2),
    naming the world sizes these flags do work at where the refusal depends on the world size (a restart at
    another size, or a launch at one the flags' TP x PP x CP do not divide)."""
    try:
        return validate_args(parse_command_line(argv), world_size)
    except ArgumentError as err:
        lines = str(err).splitlines()
        try:
            sizes = world_sizes_that_work(parse_command_line(argv), world_size) if len(lines) == 1 else []
        except ArgumentError:
            sizes = []
        if sizes:
            again = " after a restart" if restart_count() else ""
            lines = [f"at world size {world_size}{again}: {lines[0]}; these flags work at world size "
                     f"{', '.join(map(str, sizes))}"]
        if rank == 0:
            for line in lines:
                print(f"pretrain_gpt.py: error: {line}", file=sys.stderr)
        raise SystemExit(2) from None


def resize_line(client: dict, parallel) -> Optional[str]:
    """One line when the checkpoint was saved at another DP: the micro-batches a step before and now (the
    global batch is the same). None at the same DP, or where the checkpoint does not record its DP."""
    recorded = client.get("args") or {}
    saved = recorded.get("data_parallel_size") if isinstance(recorded, dict) else getattr(
        recorded, "data_parallel_size", None)
    dp = parallel.data_parallel_size
    if not saved or saved == dp or parallel.global_batch_size is None:
        return None
    per_step = parallel.global_batch_size // parallel.micro_batch_size
    before = per_step // saved if per_step % saved == 0 else f"{per_step / saved:g}"
    again = " after a restart" if restart_count() else ""
    return (f"resuming at DP={dp}{again} (saved at DP={saved}): {per_step // dp} micro-batches a step instead "
            f"of {before}, the global batch of {parallel.global_batch_size} samples kept")


def note_resize(client: dict, parallel, log) -> None:
    """log(resize_line(...)) where there is one (`parallel`: the run's ParallelConfig)."""
    line = resize_line(client, parallel)
    if line:
        log(line)
