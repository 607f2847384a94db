"""Manifest checksums: CRC-32C written, the older zlib CRC-32 still verified, unknown algorithms named."""
import zlib

import crc32c
import pytest

from megatron_zero.checkpoint.storage.checksum import Checksum, algorithm_of, file_checksum
from megatron_zero.checkpoint.errors import CheckpointError
from megatron_zero.checkpoint.storage.tensor_io import verify_file


def test_crc32c_standard_check_value_and_incremental(tmp_path):
    c = Checksum()
    c.update(b"12345")
    c.update(memoryview(b"6789"))
    assert str(c) == "crc32c:e3069283"  # the CRC-32C check value of "123456789"
    path = tmp_path / "f"
    data = bytes(range(256)) * 70_000  # more than one read buffer
    path.write_bytes(data)
    assert file_checksum(str(path)) == f"crc32c:{crc32c.crc32c(data):08x}"
    assert file_checksum(str(path), "crc32") == f"crc32:{zlib.crc32(data):08x}"


def test_older_crc32_manifests_verify_and_damage_is_named(tmp_path):
    path = tmp_path / "a.pt"
    path.write_bytes(b"x" * 1000)
    recorded = f"crc32:{zlib.crc32(b'x' * 1000):08x}"
    verify_file(str(path), recorded)
    path.write_bytes(b"x" * 999 + b"y")
    with pytest.raises(CheckpointError, match="a.pt fails its checksum"):
        verify_file(str(path), recorded)


def test_unknown_algorithm_is_one_sentence():
    with pytest.raises(CheckpointError, match="unknown algorithm 'md5'.*known: crc32, crc32c"):
        algorithm_of("md5:00", "x.pt")
