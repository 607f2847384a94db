"""The only source of sample ordering: global batches of the shuffled dataset.

Global batch k is dataset indices [k*G, (k+1)*G) (when counting from consumed 0).
Inside it, micro-step j covers [k*G + j*m*DP, k*G + (j+1)*m*DP) and DP rank r takes
the m consecutive indices starting at offset r*m of that range, as Megatron's
MegatronPretrainingSampler does. Changing DP or m changes only who reads what and
in how many steps; the set of samples in each global batch never changes.
Shuffling is the dataset's business (its shuffle index), not the sampler's.

With a global batch that grows (--rampup-batch-size, --step-batch-size-schedule: config/batch_schedule.py),
`batch_size_at(consumed)` gives each global batch's size G_k from the samples consumed before it:
batch k is [C_k, C_k + G_k) with C_{k+1} = C_k + G_k, split the same way, as Megatron's sampler
(which advances consumed_samples by m * DP per micro-batch) reads it.
"""
from __future__ import annotations

from typing import Callable, Iterator, List, Optional


class GlobalBatchSampler:
    """Yields, for one DP rank, the index list of each of its micro-batches in order.

    Resuming: pass the consumed-samples count saved with the checkpoint; the
    sequence continues exactly where the uninterrupted run would be. Only complete
    global batches are produced (the tail shorter than G is dropped).
    """

    def __init__(self, total_samples: int, consumed_samples: int, micro_batch_size: int,
                 global_batch_size: int, dp_rank: int, dp_size: int,
                 batch_size_at: Optional[Callable[[int], int]] = None):
        if micro_batch_size <= 0 or dp_size <= 0 or global_batch_size <= 0:
            raise ValueError("micro_batch_size, global_batch_size and dp_size must be positive.")
        if global_batch_size % (micro_batch_size * dp_size):
            raise ValueError(f"--global-batch-size {global_batch_size} must be a multiple of "
                             f"--micro-batch-size {micro_batch_size} times the data-parallel size {dp_size}.")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} is outside [0, {dp_size}).")
        if not 0 <= consumed_samples <= total_samples:
            raise ValueError(f"consumed_samples {consumed_samples} is outside [0, total_samples {total_samples}].")
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.global_batch_size = global_batch_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.batch_size_at = batch_size_at or (lambda consumed: global_batch_size)

    def _starts(self) -> Iterator[tuple]:
        """(start, global batch size) of each complete global batch from consumed_samples on."""
        start = self.consumed_samples
        while True:
            size = self.batch_size_at(start)
            if size % (self.micro_batch_size * self.dp_size):
                raise ValueError(f"the global batch at sample {start} is {size}, not a multiple of the micro-batch "
                                 f"size {self.micro_batch_size} times the data-parallel size {self.dp_size}.")
            if start + size > self.total_samples:
                return
            yield start, size
            start += size

    @property
    def num_micro_batches(self) -> int:
        """Gradient-accumulation steps per global batch (the first one's, where the batch grows)."""
        return self.batch_size_at(self.consumed_samples) // (self.micro_batch_size * self.dp_size)

    @property
    def num_global_batches(self) -> int:
        return sum(1 for _ in self._starts())

    def __len__(self) -> int:
        return sum(size // (self.micro_batch_size * self.dp_size) for _, size in self._starts())

    def global_batch(self, start: int) -> List[List[int]]:
        """This rank's micro-batches of the global batch beginning at sample `start`."""
        m, step = self.micro_batch_size, self.micro_batch_size * self.dp_size
        first = start + self.dp_rank * m
        return [list(range(first + j * step, first + j * step + m)) for j in range(self.batch_size_at(start) // step)]

    def __iter__(self) -> Iterator[List[int]]:
        for start, _ in self._starts():
            yield from self.global_batch(start)
