"""Megatron's mmap indexed dataset: a `.bin` of tokens and an `.idx` describing it.

`.idx` layout (little-endian), identical to Megatron-LM's `_IndexWriter`:

    b"MMIDIDX\\x00\\x00"           9-byte magic
    uint64  version = 1
    uint8   dtype code             (DTYPE_CODES below)
    uint64  sequence count S
    uint64  document-index count D (= number of documents + 1)
    int32[S]  sequence lengths in tokens
    int64[S]  sequence byte offsets into `.bin`
    int64[D]  document indices: document d is sequences [idx[d], idx[d+1])
    (int8[S]  sequence modes, multimodal datasets only)

`.bin` is the tokens of all sequences, concatenated, in the dtype above.
Without sentence splitting (our preprocess) every document is one sequence.

Megatron-DeepSpeed's `tools/preprocess_data.py --append-eod` writes the end-of-document
token into the `.bin` but leaves it out of the sequence lengths (and so of the pointers).
Such a pair is recognised exactly: the pointers follow the lengths, the `.bin` holds
exactly one token more per non-empty document than the lengths sum to, and the token
after each non-empty document (where that layout puts it) is the same id in every
document. It is then read with each document's last sequence one token longer (its EOD),
as Megatron-LM's preprocess counts it, and one line says so.
"""
from __future__ import annotations

import os
import struct
import sys
from typing import Iterable, Optional

import numpy as np

from .errors import DataError

INDEX_HEADER = b"MMIDIDX\x00\x00"
HEADER_SIZE = 9 + 8 + 1 + 8 + 8
DTYPE_CODES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64,
               6: np.float64, 7: np.float32, 8: np.uint16}
CODE_OF_DTYPE = {np.dtype(v): k for k, v in DTYPE_CODES.items()}


def optimal_dtype(vocab_size: Optional[int]):
    """Megatron's choice: uint16 when every token id fits below 65500, else int32."""
    return np.uint16 if vocab_size is not None and vocab_size < 65500 else np.int32


def idx_path(prefix: str) -> str:
    return prefix + ".idx"


def bin_path(prefix: str) -> str:
    return prefix + ".bin"


class IndexedDatasetBuilder:
    """Writes `{prefix}.bin` while documents arrive; `finalize()` writes `{prefix}.idx`.

    Both files are written under temporary names and renamed by `finalize()`, so a
    crash never leaves a pair that looks complete.
    """

    def __init__(self, prefix: str, dtype=np.int32):
        self.prefix = prefix
        self.dtype = np.dtype(dtype)
        if self.dtype not in CODE_OF_DTYPE:
            raise ValueError(f"dtype {self.dtype} has no Megatron dtype code")
        self._bin_tmp = bin_path(prefix) + ".tmp"
        self._bin = open(self._bin_tmp, "wb")
        self.sequence_lengths: list = []
        self.document_indices: list = [0]

    def add_document(self, tokens: Iterable[int], lengths: Optional[list] = None) -> None:
        """Append one document; `lengths` splits it into sequences (default: one sequence)."""
        arr = np.asarray(tokens, dtype=self.dtype)
        self._bin.write(arr.tobytes(order="C"))
        self.sequence_lengths.extend([arr.size] if lengths is None else lengths)
        self.document_indices.append(len(self.sequence_lengths))

    def finalize(self) -> None:
        self._bin.close()
        tmp = idx_path(self.prefix) + ".tmp"
        write_index(tmp, self.sequence_lengths, self.document_indices, self.dtype)
        os.replace(self._bin_tmp, bin_path(self.prefix))
        os.replace(tmp, idx_path(self.prefix))

    def abort(self) -> None:
        self._bin.close()
        for p in (self._bin_tmp, idx_path(self.prefix) + ".tmp"):
            if os.path.exists(p):
                os.remove(p)


def write_index(path: str, sequence_lengths, document_indices, dtype) -> None:
    lengths = np.asarray(sequence_lengths, dtype=np.int32)
    pointers = np.zeros(len(lengths), dtype=np.int64)
    np.cumsum(lengths[:-1].astype(np.int64) * np.dtype(dtype).itemsize, out=pointers[1:])
    with open(path, "wb") as f:
        f.write(INDEX_HEADER)
        f.write(struct.pack("<Q", 1))
        f.write(struct.pack("<B", CODE_OF_DTYPE[np.dtype(dtype)]))
        f.write(struct.pack("<Q", len(lengths)))
        f.write(struct.pack("<Q", len(document_indices)))
        f.write(lengths.tobytes(order="C"))
        f.write(pointers.tobytes(order="C"))
        f.write(np.asarray(document_indices, dtype=np.int64).tobytes(order="C"))


def _note(line: str) -> None:
    """One line on stderr, from global rank 0 only."""
    try:
        import torch.distributed as dist
        quiet = dist.is_available() and dist.is_initialized() and dist.get_rank() != 0
    except ImportError:
        quiet = False
    if not quiet:
        print(f"note: {line}", file=sys.stderr, flush=True)


class IndexedDataset:
    """Read-only, memory-mapped view of a `{prefix}.bin/.idx` pair.

    `ds[i]` is sequence i as a numpy array (a view into the mmap, nothing copied);
    `ds.get(i, offset, length)` reads part of one. The pair is checked at open:
    a truncated or mismatched pair raises DataError saying which file and why.
    """

    def __init__(self, prefix: str, mmap_bin: bool = True):
        """mmap_bin False (--no-mmap-bin-files): tokens are read from the .bin with plain reads."""
        self.prefix = prefix
        self.eod_uncounted: Optional[int] = None  # the EOD id when the .idx leaves it out (Megatron-DeepSpeed)
        ip, bp = idx_path(prefix), bin_path(prefix)
        for p in (ip, bp):
            if not os.path.isfile(p):
                raise DataError(f"{p} does not exist (a dataset prefix needs both {prefix}.bin and {prefix}.idx).")
        self._read_index(ip)
        self._check_bin(bp)
        self._bin_path = bp
        self._bin = (np.memmap(bp, dtype=np.uint8, mode="r") if self._bin_size and mmap_bin else
                     None if self._bin_size else np.zeros(0, np.uint8))

    def _read_index(self, ip: str) -> None:
        size = os.path.getsize(ip)
        if size < HEADER_SIZE:
            raise DataError(f"{ip} is truncated: {size} bytes is shorter than the {HEADER_SIZE}-byte header.")
        with open(ip, "rb") as f:
            head = f.read(HEADER_SIZE)
        if head[:9] != INDEX_HEADER:
            raise DataError(f"{ip} is not a Megatron mmap index: it does not start with b'MMIDIDX\\x00\\x00'.")
        version, code, n_seq, n_doc = struct.unpack("<QBQQ", head[9:])
        if version != 1:
            raise DataError(f"{ip} has index version {version}, but only version 1 is supported.")
        if code not in DTYPE_CODES:
            raise DataError(f"{ip} has unknown dtype code {code} (known codes are 1-8).")
        self.dtype = np.dtype(DTYPE_CODES[code])
        expected = HEADER_SIZE + 12 * n_seq + 8 * n_doc
        if size < expected:
            raise DataError(f"{ip} is truncated: its header announces {n_seq} sequences and {n_doc - 1} "
                            f"documents ({expected} bytes) but the file has {size} bytes.")
        if size not in (expected, expected + n_seq):
            raise DataError(f"{ip} has {size - expected} bytes after the document indices; "
                            f"its header does not match its contents.")
        idx = np.memmap(ip, dtype=np.uint8, mode="r")
        self.sequence_lengths = idx[HEADER_SIZE:HEADER_SIZE + 4 * n_seq].view(np.int32)
        o = HEADER_SIZE + 4 * n_seq
        self.sequence_pointers = idx[o:o + 8 * n_seq].view(np.int64)
        o += 8 * n_seq
        self.document_indices = idx[o:o + 8 * n_doc].view(np.int64)
        o += 8 * n_doc
        self.sequence_modes = idx[o:o + n_seq].view(np.int8) if size > expected else None
        d = self.document_indices
        if n_doc < 1 or d[0] != 0 or d[-1] != n_seq or np.any(np.diff(d) < 0):
            raise DataError(f"{ip} has inconsistent document indices (they must rise from 0 to the sequence count {n_seq}).")

    def _check_bin(self, bp: str) -> None:
        size = os.path.getsize(bp)
        item = self.dtype.itemsize
        n = len(self.sequence_lengths)
        need = int(self.sequence_pointers[-1]) + int(self.sequence_lengths[-1]) * item if n else 0
        if n and (self.sequence_pointers[0] != 0 or np.any(
                np.diff(self.sequence_pointers) != self.sequence_lengths[:-1].astype(np.int64) * item)):
            raise DataError(f"{idx_path(self.prefix)} has sequence pointers that do not follow its sequence lengths.")
        if size < need:
            raise DataError(f"{bp} is truncated: {idx_path(self.prefix)} describes {need} bytes of "
                            f"{self.dtype.name} tokens but the .bin has {size} bytes.")
        if size > need and self._read_eod_uncounted(size, need // item):
            need = size
        if size > need:
            raise DataError(f"{bp} does not match {idx_path(self.prefix)}: the index describes {need} bytes "
                            f"but the .bin has {size} bytes (were they written by different runs?).")
        self._bin_size = size

    def _read_eod_uncounted(self, bin_size: int, counted: int) -> bool:
        """Recognise Megatron-DeepSpeed's --append-eod pair (module docstring); if it is one, count each EOD."""
        if self.sequence_modes is not None or bin_size % self.dtype.itemsize:
            return False
        bin_tokens = bin_size // self.dtype.itemsize
        lengths = np.asarray(self.sequence_lengths, dtype=np.int64)
        ends = np.asarray(self.document_indices[1:], dtype=np.int64)
        cumulative = np.concatenate([[0], np.cumsum(lengths)])
        doc_tokens = cumulative[ends] - cumulative[np.asarray(self.document_indices[:-1], dtype=np.int64)]
        nonempty = doc_tokens > 0
        if counted + int(nonempty.sum()) != bin_tokens or not nonempty.any():
            return False
        fixed = lengths.copy()
        fixed[ends[nonempty] - 1] += 1
        eod_at = np.cumsum(fixed)[ends[nonempty] - 1] - 1
        gaps = np.asarray(np.memmap(bin_path(self.prefix), dtype=self.dtype, mode="r")[eod_at])
        if np.any(gaps != gaps[0]):
            return False
        self.sequence_lengths = fixed.astype(np.int32)
        self.sequence_pointers = np.zeros(len(fixed), dtype=np.int64)
        np.cumsum(fixed[:-1] * self.dtype.itemsize, out=self.sequence_pointers[1:])
        self.eod_uncounted = int(gaps[0])
        _note(f"{idx_path(self.prefix)} was written by Megatron-DeepSpeed's preprocess_data.py --append-eod (its "
              f"sizes leave out each document's end-of-document token {int(gaps[0])}); reading each document with it")
        return True

    def __len__(self) -> int:
        return len(self.sequence_lengths)

    @property
    def num_documents(self) -> int:
        return len(self.document_indices) - 1

    def get(self, i: int, offset: int = 0, length: Optional[int] = None) -> np.ndarray:
        n = int(self.sequence_lengths[i])
        if length is None:
            length = n - offset
        start = int(self.sequence_pointers[i]) + offset * self.dtype.itemsize
        if self._bin is None:
            return np.fromfile(self._bin_path, dtype=self.dtype, count=length, offset=start)
        return self._bin[start:start + length * self.dtype.itemsize].view(self.dtype)

    def __getitem__(self, i: int) -> np.ndarray:
        return self.get(int(i))

    def document(self, d: int) -> np.ndarray:
        """All tokens of document d (its sequences concatenated)."""
        s, e = int(self.document_indices[d]), int(self.document_indices[d + 1])
        if e == s:
            return np.zeros(0, self.dtype)
        return np.concatenate([self.get(i) for i in range(s, e)]) if e - s > 1 else self.get(s)
