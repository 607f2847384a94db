"""Which data-parallel rank orthogonalizes which matrix, as a pure function: each parameter goes, in decreasing
order of its Newton-Schulz FLOPs, to the rank with the least work so far (longest-processing-time first; ties to
the lower rank, then the earlier parameter), so every rank computes the same assignment and the busiest rank's
work is at most 4/3 of the best possible (Graham's bound), not a parameter count's 'every dp-th'."""
from __future__ import annotations

from typing import List, Sequence


def assign_owners(costs: Sequence[int], ranks: int) -> List[int]:
    """owner[i] in [0, ranks) of each item of cost costs[i]."""
    load = [0] * ranks
    owner = [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        r = min(range(ranks), key=lambda r: (load[r], r))
        owner[i] = r
        load[r] += costs[i]
    return owner


def loads(costs: Sequence[int], owner: Sequence[int], ranks: int) -> List[int]:
    out = [0] * ranks
    for c, r in zip(costs, owner):
        out[r] += c
    return out
