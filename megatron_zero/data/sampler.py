"""The only source of sample ordering: global batches of the shuffled dataset.

Global batch k is dataset indices [k*G, (k+1)*G) (when counting from consumed 0).
Inside it, micro-step j covers [k*G + j*m*DP, k*G + (j+1)*m*DP) and DP rank r takes
the m consecutive indices starting at offset r*m of that range, as Megatron's
MegatronPretrainingSampler does. Changing DP or m changes only who reads what and
in how many steps; the set of samples in each global batch never changes.
Shuffling is the dataset's business (its shuffle index), not the sampler's.
"""
from __future__ import annotations

from typing import Iterator, List


class GlobalBatchSampler:
    """Yields, for one DP rank, the index list of each of its micro-batches in order.

    Resuming: pass the consumed-samples count saved with the checkpoint; the
    sequence continues exactly where the uninterrupted run would be. Only complete
    global batches are produced (the tail shorter than G is dropped).
    """

    def __init__(self, total_samples: int, consumed_samples: int, micro_batch_size: int,
                 global_batch_size: int, dp_rank: int, dp_size: int):
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

    @property
    def num_micro_batches(self) -> int:
        """Gradient-accumulation steps per global batch."""
        return self.global_batch_size // (self.micro_batch_size * self.dp_size)

    @property
    def num_global_batches(self) -> int:
        return (self.total_samples - self.consumed_samples) // self.global_batch_size

    def __len__(self) -> int:
        return self.num_global_batches * self.num_micro_batches

    def global_batch(self, start: int) -> List[List[int]]:
        """This rank's micro-batches of the global batch beginning at sample `start`."""
        m, step = self.micro_batch_size, self.micro_batch_size * self.dp_size
        first = start + self.dp_rank * m
        return [list(range(first + j * step, first + j * step + m)) for j in range(self.num_micro_batches)]

    def __iter__(self) -> Iterator[List[int]]:
        for k in range(self.num_global_batches):
            yield from self.global_batch(self.consumed_samples + k * self.global_batch_size)
