"""Importing torchao (FP8) prints nothing of its own on the ranks: an emulated FP8 run on 2 CPU ranks from
pretrain_gpt.py has no torchao extension-loading warning and no torch pytree Enum deprecation in its output, and
the filter drops only those records (fp8/import_noise.py)."""
import logging

import pytest

from megatron_zero.testing.launch import byte_data, tiny_flags, torchrun

pytest.importorskip("torchao")
NOISE = ("Failed to load", "is an Enum subclass")


def test_fp8_run_prints_no_import_noise(tmp_path):
    run = torchrun(2, tiny_flags(tmp_path, byte_data(str(tmp_path / "bytes")),
                                 **{"fp8-format": "hybrid", "fp8-emulate": True, "train-iters": 1}))
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-3000:]
    assert not [line for line in out.splitlines() if any(n in line for n in NOISE)]


def test_filter_drops_only_those_records(caplog):
    import megatron_zero.fp8  # noqa: F401  (installs the filters)
    with caplog.at_level(logging.WARNING):
        logging.getLogger("torchao").warning("Failed to load /x/torchao/_C_mxfp8.so: nope")
        logging.getLogger("torchao").warning("something else")
        logging.getLogger("torch.utils._pytree").warning("%s is an Enum subclass and is now natively supported", "E")
    assert [r.getMessage() for r in caplog.records] == ["something else"]
