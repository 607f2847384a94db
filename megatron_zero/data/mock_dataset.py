"""--mock-data: synthetic GPT samples, no files (Megatron's mock dataset, for trying a launch script).

Sample i of a split is seq_length+1 consecutive token ids, (offset + k) mod vocab_size, the offset
drawn from (seed, split, i): a pattern a model learns, the same on every rank and run.
"""
from __future__ import annotations

import numpy as np


class MockGPTDataset:
    def __init__(self, num_samples: int, seq_length: int, vocab_size: int, seed: int, split: int):
        self.num_samples, self.seq_length, self.vocab_size = int(num_samples), seq_length, vocab_size
        self.offsets = np.random.RandomState([seed, split]).randint(0, vocab_size, size=max(1, self.num_samples))

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, idx: int) -> np.ndarray:
        offset = int(self.offsets[int(idx) % len(self.offsets)])
        return (offset + np.arange(self.seq_length + 1, dtype=np.int64)) % self.vocab_size
