"""Stream tensors into torch.save's zip format, one tensor at a time, from any device.

    with TorchZipWriter("pytorch_model.bin") as w:
        for name, t in tensors:          # each tensor's bytes are written at once, then it can go
            w.add(name, t)
    torch.load("pytorch_model.bin", weights_only=True, mmap=True)   # {name: tensor}, as torch.save wrote it

    with TorchZipWriter(path) as w:      # or any picklable object holding tensors (an optimizer state)
        w.write_object(obj)

torch.save pickles the whole object first and so needs every tensor at hand; here each tensor
becomes its storage record `archive/data/<k>` as soon as it is added, and `archive/data.pkl`
(which refers to storages by key through persistent ids) is pickled at the end from the
recorded names, dtypes and shapes. Peak memory is one tensor, not the state dict.
`write_object` pickles an arbitrary object the same way torch.save does, each tensor met
(wherever it sits in the object) becoming a storage record of exactly its own bytes: a view
of a big flat buffer writes only the view, where torch.save writes the whole storage.
A tensor's bytes go to the file through a `HostStaging` (staging.py): a host tensor from its
own memory, a device tensor through the bounded host buffer, chunk by chunk, so saving from a
GPU needs at most that buffer of host memory, not a host copy of the largest tensor. The
storages are recorded with location 'cpu' (a file saved from a GPU loads on a machine without
one; loaders pass their device as map_location).

The layout is miniz's (torch's writer): stored records, local headers padded with an 'FB'
extra field so every record's data starts on a 64-byte boundary (torch.load(mmap=True) maps
storages in place), a data descriptor after each record, ZIP64 fields past 4 GiB, and the
records torch.load reads (`data.pkl`, `.format_version`, `.storage_alignment`, `byteorder`,
`version`). The data.pkl bytes equal torch.save's for the same dict. Storage records carry
CRC 0, as torch's own writer does with its CRC option off (torch.load does not check it).
A tensor that is a view of a memory-mapped file (e.g. a fragment of an optimizer file opened
with torch.load(mmap=True)) is copied file-to-file in the kernel (copy_file_range), without
faulting its pages into this process — only with copy_files=True, for callers that never
modify mapped tensors (a private mapping's modified pages differ from the file).
"""
from __future__ import annotations

import collections
import io
import os
import pickle
import struct
import sys
import zlib
from typing import Callable, Dict, List, Optional, Tuple

import torch

from .safe_pickle import PICKLED_AS
from .staging import HostStaging, default_staging

ALIGN = 64
CHUNK = 8 << 20
_U32 = 0xFFFFFFFF


# The legacy storage class torch.save names for each dtype in data.pkl (the public torch.*Storage
# classes; test_consolidate_fp32 checks the table against torch's own mapping).
STORAGE_TYPES = {
    torch.float32: "FloatStorage", torch.float64: "DoubleStorage", torch.float16: "HalfStorage",
    torch.bfloat16: "BFloat16Storage", torch.int64: "LongStorage", torch.int32: "IntStorage",
    torch.int16: "ShortStorage", torch.int8: "CharStorage", torch.uint8: "ByteStorage",
    torch.bool: "BoolStorage", torch.complex64: "ComplexFloatStorage", torch.complex128: "ComplexDoubleStorage",
}


def _storage_type(dtype: torch.dtype):
    if dtype not in STORAGE_TYPES:
        raise ValueError(f"cannot stream a {dtype} tensor into a torch.save file; "
                         f"supported dtypes: {', '.join(str(d) for d in STORAGE_TYPES)}")
    return getattr(torch, STORAGE_TYPES[dtype])


class _Storage:
    def __init__(self, key: str, dtype: torch.dtype, numel: int):
        self.key, self.dtype, self.numel = key, dtype, numel


class _Tensor:
    """Pickles exactly as a contiguous CPU tensor does. torch._utils._rebuild_tensor_v2 is not ours to
    avoid: it is the name torch.save writes and torch.load's weights_only allow-list accepts, the same
    in every torch since 1.x (the format, not an implementation detail we call)."""

    def __init__(self, storage: _Storage, shape: Tuple[int, ...]):
        self.storage, self.shape = storage, shape

    def __reduce_ex__(self, protocol):
        stride, acc = [], 1
        for d in reversed(self.shape):
            stride.append(acc)
            acc *= d
        return (torch._utils._rebuild_tensor_v2,
                (self.storage, 0, tuple(self.shape), tuple(reversed(stride)), False, collections.OrderedDict()))


class _Pickler(pickle._Pickler):
    """torch.save's pickling: storages by persistent id; with `on_tensor`, every tensor reduced by it.

    The stand-ins of safe_pickle.PICKLED_AS (DeepSpeed's fragment_address and loss scalers, Megatron's
    ModelType) are written under the name of the class they stand for, so DeepSpeed and Megatron-DeepSpeed
    unpickle their own classes, while neither needs to be importable here. That needs pickle's Python
    implementation (its C one insists on importing a global it writes); the pickled structure is KiB."""

    def __init__(self, f, on_tensor: Optional[Callable[[torch.Tensor], _Tensor]] = None):
        super().__init__(f, protocol=2)
        self.on_tensor = on_tensor

    def save_global(self, obj, name=None):
        path = PICKLED_AS.get(obj) if isinstance(obj, type) else None
        if path is None:
            return super().save_global(obj, name)
        module, qualname = path.rsplit(".", 1)
        self.write(pickle.GLOBAL + module.encode() + b"\n" + qualname.encode() + b"\n")
        self.memoize(obj)

    def persistent_id(self, obj):
        if isinstance(obj, _Storage):
            return ("storage", _storage_type(obj.dtype), obj.key, "cpu", obj.numel)
        return None

    def reducer_override(self, obj):
        if self.on_tensor is not None and torch.is_tensor(obj):
            return self.on_tensor(obj).__reduce_ex__(2)
        return NotImplemented


class _Mappings:
    """Which file (and offset) backs an address of this process, from /proc/self/maps (Linux).

    The table is re-read only on a miss or when its entry no longer names the same file
    (/proc/self/map_files/<range> is checked, one readlink): files unmapped and others mapped
    at the same addresses are never confused."""

    def __init__(self):
        self.table: List[Tuple[int, int, str, str, int]] = []

    def _read(self) -> None:
        self.table = []
        try:
            with open("/proc/self/maps") as f:
                lines = f.read().splitlines()
        except OSError:
            return
        for line in lines:
            if line.endswith(".so") or ".so." in line[line.rfind("/"):]:  # shared libraries: not data files
                continue
            parts = line.split(None, 5)
            if len(parts) == 6 and parts[5].startswith("/") and not parts[5].endswith("(deleted)"):
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                self.table.append((lo, hi, parts[0], parts[5], int(parts[2], 16)))

    def _find(self, ptr: int, nbytes: int) -> Optional[Tuple[str, int]]:
        for lo, hi, span, path, pgoff in self.table:
            if lo <= ptr and ptr + nbytes <= hi:
                try:
                    if os.readlink(f"/proc/self/map_files/{span}") != path:
                        return None
                except OSError:
                    return None
                return path, pgoff + ptr - lo
        return None

    def lookup(self, ptr: int, nbytes: int) -> Optional[Tuple[str, int]]:
        """(path, file offset) when [ptr, ptr+nbytes) lies in one file mapping, else None."""
        found = self._find(ptr, nbytes)
        if found is None:
            self._read()
            found = self._find(ptr, nbytes)
        return found


class TensorBytesWriter:
    """Appends tensors' raw bytes to an open file descriptor: from memory (a device tensor through
    `staging`), or with copy_files=True, file-to-file (copy_file_range) for views of memory-mapped files."""

    def __init__(self, fd: int, copy_files: bool = False, staging: Optional[HostStaging] = None):
        self.fd, self.copy_files, self.pos = fd, copy_files, os.lseek(fd, 0, os.SEEK_CUR)
        self.staging = staging or default_staging()
        self._sources: Dict[str, int] = {}
        self._maps = _Mappings()

    def write(self, data) -> None:
        mv = memoryview(data).cast("B")
        done = 0
        while done < len(mv):
            done += os.write(self.fd, mv[done:done + CHUNK])
        self.pos += len(mv)

    def _copy_from_file(self, t: torch.Tensor, nbytes: int) -> bool:
        where = self._maps.lookup(t.data_ptr(), nbytes)
        if where is None:
            return False
        path, off = where
        src = self._sources.get(path)
        if src is None:
            try:
                src = self._sources[path] = os.open(path, os.O_RDONLY)
            except OSError:
                return False
        done = 0
        try:
            while done < nbytes:
                n = os.copy_file_range(src, self.fd, nbytes - done, off + done)
                if n == 0:
                    raise OSError("copy_file_range copied nothing")
                done += n
        except OSError:
            if done:  # rewind what was copied and write from memory instead
                os.lseek(self.fd, self.pos, os.SEEK_SET)
            return False
        self.pos += nbytes
        return True

    def write_tensor(self, t: torch.Tensor) -> int:
        """Write a tensor's bytes (C order, from any device); returns their count."""
        nbytes = t.numel() * t.element_size()
        if nbytes and not (self.copy_files and t.device.type == "cpu" and t.is_contiguous()
                           and hasattr(os, "copy_file_range") and self._copy_from_file(t, nbytes)):
            for view in self.staging.chunks(t):
                self.write(view)
        return nbytes

    def finish(self) -> None:
        """Called once all bytes are written, before the file is closed."""
        self.close_sources()

    def close_sources(self) -> None:
        for fd in self._sources.values():
            os.close(fd)
        self._sources.clear()


def cpu_contiguous(tensor: torch.Tensor) -> torch.Tensor:
    t = tensor.detach()
    return (t.cpu() if t.device.type != "cpu" else t).contiguous()


class TorchZipWriter:
    """`out` makes the byte sink for the open file (default: a TensorBytesWriter with `copy_files`)."""

    def __init__(self, path: str, archive: str = "archive", force_zip64: bool = False, copy_files: bool = False,
                 out: Optional[Callable[[int], TensorBytesWriter]] = None):
        self.path, self.archive, self.force_zip64 = path, archive, force_zip64
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self.out = out(self.fd) if out is not None else TensorBytesWriter(self.fd, copy_files)
        self.central: List[bytes] = []
        self.entries: Dict[str, _Tensor] = {}
        self.storages = 0
        self.pickled: Optional[bytes] = None  # write_object's data.pkl

    @property
    def pos(self) -> int:
        return self.out.pos

    # --- zip records -------------------------------------------------------------------------
    def _write(self, data) -> None:
        self.out.write(data)

    def _header(self, name: str, size: int) -> Tuple[bytes, int, bool]:
        raw = f"{self.archive}/{name}".encode()
        offset = self.pos
        zip64 = self.force_zip64 or size >= _U32 or offset >= _U32
        extra = struct.pack("<HHQQ", 1, 16, 0, 0) if zip64 else b""
        start = offset + 30 + len(raw) + len(extra) + 4  # 4: the FB field's own header
        extra += struct.pack("<HH", 0x4246, -start % ALIGN) + b"Z" * (-start % ALIGN)
        head = struct.pack("<IHHHHHIIIHH", 0x04034B50, 45 if zip64 else 20, 0x0808, 0, 0, 0x21, 0, 0, 0,
                           len(raw), len(extra))
        self._write(head + raw + extra)
        return raw, offset, zip64

    def _finish(self, raw: bytes, offset: int, zip64: bool, size: int, crc: int) -> None:
        self._write(struct.pack("<IIQQ" if zip64 else "<IIII", 0x08074B50, crc, size, size))
        extra = b""
        if zip64:
            extra = struct.pack("<HHQQQ", 1, 24, size, size, offset)
        small = _U32 if zip64 else size
        self.central.append(struct.pack("<IHHHHHHIIIHHHHHII", 0x02014B50, 45 if zip64 else 20, 45 if zip64 else 20,
                                        0x0808, 0, 0, 0x21, crc, small, small, len(raw), len(extra), 0, 0, 0, 0,
                                        _U32 if zip64 else offset) + raw + extra)

    def _record(self, name: str, data: bytes) -> None:
        raw, offset, zip64 = self._header(name, len(data))
        self._write(data)
        self._finish(raw, offset, zip64, len(data), zlib.crc32(data))

    def _storage(self, t: torch.Tensor) -> _Tensor:
        """Write `t`'s bytes now as the next storage record; the placeholder data.pkl refers to it by."""
        storage = _Storage(str(self.storages), t.dtype, t.numel())
        _storage_type(t.dtype)  # refuse an unsupported dtype before writing
        self.storages += 1
        nbytes = t.numel() * t.element_size()
        raw, offset, zip64 = self._header(f"data/{storage.key}", nbytes)
        self.out.write_tensor(t)
        self._finish(raw, offset, zip64, nbytes, 0)
        return _Tensor(storage, tuple(t.shape))

    def add(self, name: str, tensor: torch.Tensor) -> int:
        """Write `tensor`'s bytes now as the next storage record; returns their size."""
        if name in self.entries:
            raise ValueError(f"{name} was already written")
        self.entries[name] = self._storage(tensor.detach())
        return tensor.numel() * tensor.element_size()

    def write_object(self, obj) -> None:
        """Write every tensor in `obj` (one record per distinct tensor, shared ones once); obj becomes data.pkl."""
        if self.entries or self.pickled is not None:
            raise ValueError("write_object writes a file's whole content: call it once, without add()")
        written: Dict[tuple, _Tensor] = {}

        def on_tensor(t: torch.Tensor) -> _Tensor:
            key = (t.data_ptr(), t.dtype, tuple(t.shape), tuple(t.stride()), t.device)
            if key not in written:
                written[key] = self._storage(t.detach())
            return written[key]

        buf = io.BytesIO()
        _Pickler(buf, on_tensor).dump(obj)
        self.pickled = buf.getvalue()

    def close(self) -> int:
        """Write data.pkl, the small records and the central directory; returns the file size."""
        if self.fd is None:
            return self.pos
        if self.pickled is None:
            buf = io.BytesIO()
            _Pickler(buf).dump(dict(self.entries))
            self.pickled = buf.getvalue()
        self._record("data.pkl", self.pickled)
        self._record(".format_version", b"1")
        self._record(".storage_alignment", str(ALIGN).encode())
        self._record("byteorder", sys.byteorder.encode())
        self._record("version", b"3\n")
        start, n = self.pos, len(self.central)
        for entry in self.central:
            self._write(entry)
        size = self.pos - start
        if self.force_zip64 or start >= _U32 or n >= 0xFFFF:
            eocd64 = self.pos
            self._write(struct.pack("<IQHHIIQQQQ", 0x06064B50, 44, 45, 45, 0, 0, n, n, size, start))
            self._write(struct.pack("<IIQI", 0x07064B50, 0, eocd64, 1))
            self._write(struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, 0xFFFF, 0xFFFF, _U32, _U32, 0))
        else:
            self._write(struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, n, n, size, start, 0))
        self.out.finish()
        os.close(self.fd)
        self.fd = None
        return self.pos

    def abort(self) -> None:
        """Stop and remove the partial file."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
            os.remove(self.path)
        self.out.close_sources()

    def __enter__(self):
        return self

    def __exit__(self, exc_type, *exc):
        if exc_type is None:
            self.close()
        else:
            self.abort()
