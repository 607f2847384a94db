"""--num-workers: read the next global batch on background threads while this one trains.

`BatchPrefetcher(read_micro_batch, workers)`: `get(index_lists, next_index_lists)` returns the
micro-batches of `index_lists` (read ahead when they were the previous call's `next_index_lists`)
and starts reading `next_index_lists`; each micro-batch is one `read_micro_batch(indices)` call,
spread over `workers` threads. workers = 0 reads in line. Host work only (no torch, no device).
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Callable, List, Optional, Sequence


class BatchPrefetcher:
    def __init__(self, read_micro_batch: Callable, workers: int):
        self.read = read_micro_batch
        self.pool = ThreadPoolExecutor(workers, thread_name_prefix="batch-reader") if workers > 0 else None
        self._ahead_key, self._ahead = None, None

    def _submit(self, index_lists):
        return [self.pool.submit(self.read, idx) for idx in index_lists]

    def get(self, index_lists: Sequence, next_index_lists: Optional[Sequence] = None) -> List:
        if self.pool is None:
            return [self.read(idx) for idx in index_lists]
        key = _key(index_lists)
        futures = self._ahead if key == self._ahead_key else self._submit(index_lists)
        batches = [f.result() for f in futures]
        if next_index_lists is not None:
            self._ahead_key, self._ahead = _key(next_index_lists), self._submit(next_index_lists)
        else:
            self._ahead_key, self._ahead = None, None
        return batches

    def close(self):
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)


def _key(index_lists) -> tuple:
    return tuple(tuple(int(i) for i in idx) for idx in index_lists)
