"""Which global layers each pipeline stage holds.

The model is a list of L + 4 layers (Megatron-DeepSpeed's GPTModelPipe order):
0 input cast, 1 embedding, 2 .. L+1 transformer blocks, L+2 final LayerNorm,
L+3 output head tied to the embedding. Stages split the transformer blocks; the
first stage also holds layers 0-1 and the last layers L+2, L+3.

Methods: "uniform" (blocks as even as possible, the extra ones on the first
stages, as DeepSpeed's partition_uniform does), "parameters" (balance parameter
counts, embedding counted on the first stage and final norm on the last), or an
explicit list of block counts per stage.

Interleaved (virtual) pipeline, Megatron's --num-layers-per-virtual-pipeline-stage N: the blocks
are split uniformly into pp x v virtual stages of N blocks; rank r holds the v model chunks
r, pp + r, 2 pp + r, ... (virtual_stage_layer_ranges), so the embedding is on chunk 0 of the
first rank and the final norm and head on the last chunk of the last rank.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple


class PartitionError(ValueError):
    """A partition that cannot be built (one sentence naming the numbers)."""


def _uniform(num_blocks: int, pp: int) -> List[int]:
    base, extra = divmod(num_blocks, pp)
    return [base + (1 if s < extra else 0) for s in range(pp)]


def _balanced(weights: Sequence[float], pp: int) -> List[int]:
    """Contiguous split of weights into pp non-empty parts minimising the heaviest part."""
    n = len(weights)
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    inf = float("inf")
    # best[j][i]: minimal heaviest part splitting the first i items into j parts.
    best = [[inf] * (n + 1) for _ in range(pp + 1)]
    cut = [[0] * (n + 1) for _ in range(pp + 1)]
    best[0][0] = 0.0
    for j in range(1, pp + 1):
        for i in range(j, n - (pp - j) + 1):
            for k in range(j - 1, i):
                cost = max(best[j - 1][k], prefix[i] - prefix[k])
                if cost < best[j][i]:
                    best[j][i], cut[j][i] = cost, k
    counts, i = [], n
    for j in range(pp, 0, -1):
        k = cut[j][i]
        counts.append(i - k)
        i = k
    return counts[::-1]


def block_counts(num_blocks: int, pp: int, method: str = "uniform",
                 explicit: Optional[Sequence[int]] = None,
                 block_params: int = 0, embedding_params: int = 0, final_params: int = 0) -> List[int]:
    if num_blocks < pp:
        raise PartitionError(f"{num_blocks} transformer layers cannot fill {pp} pipeline stages; "
                             "every stage needs at least one layer")
    if explicit is not None:
        explicit = [int(c) for c in explicit]
        if len(explicit) != pp or sum(explicit) != num_blocks or min(explicit) < 1:
            raise PartitionError(f"the explicit pipeline partition {explicit} must list {pp} positive layer "
                                 f"counts summing to {num_blocks}")
        return explicit
    if method == "uniform":
        return _uniform(num_blocks, pp)
    if method == "parameters":
        weights = [float(block_params)] * num_blocks
        weights[0] += embedding_params
        weights[-1] += final_params
        return _balanced(weights, pp)
    raise PartitionError(f"pipeline partition method {method!r} must be uniform, parameters or explicit counts")


def stage_layer_ranges(num_blocks: int, pp: int, **kwargs) -> List[Tuple[int, int]]:
    """[start, end) global layer indices of each stage over the L + 4 layer list."""
    counts = block_counts(num_blocks, pp, **kwargs)
    ranges, first_block = [], 0
    for stage, count in enumerate(counts):
        start = 0 if stage == 0 else first_block + 2
        end = num_blocks + 4 if stage == pp - 1 else first_block + count + 2
        ranges.append((start, end))
        first_block += count
    return ranges


def virtual_stage_layer_ranges(num_blocks: int, pp: int, vp: int) -> List[List[Tuple[int, int]]]:
    """Per rank, the [start, end) global layer ranges of its vp model chunks: chunk k of rank r is
    virtual stage k * pp + r of a uniform split into pp * vp stages."""
    if num_blocks % (pp * vp):
        raise PartitionError(f"{num_blocks} transformer layers do not split evenly into {pp} pipeline stages x "
                             f"{vp} virtual stages")
    ranges = stage_layer_ranges(num_blocks, pp * vp)
    return [[ranges[k * pp + r] for k in range(vp)] for r in range(pp)]


def parse_partition_flag(text: Optional[str]) -> Optional[List[int]]:
    """'--pipeline-partition 3,5' -> [3, 5]."""
    if not text:
        return None
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise PartitionError(f"--pipeline-partition {text!r} must be comma-separated layer counts, e.g. 3,5") from None
