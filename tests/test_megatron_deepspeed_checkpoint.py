"""Megatron-DeepSpeed's own checkpoint layouts, both ways, built from the format (no Megatron-DeepSpeed needed).

Reading: the non-pipeline layout (weights nested under module -> language_model, ZeRO-1 DP 2 and ZeRO-0 TP 2)
and the pipeline engine's (PP 2, ZeRO-0) give back exactly the tensors they were written from, in our names
and QKV order; Megatron's ModelType in the args loads as data. Writing: a ZeRO-1 DP 2, a TP 2 and a PP 2 save
with --save-megatron-deepspeed-layout has the structure Megatron-DeepSpeed's loader reads and reads back to
the saved model exactly. Comparisons are exact: every path copies and permutes, none computes.
"""
import argparse
import os
import zipfile

import pytest
import torch

from megatron_zero.checkpoint.megatron_deepspeed import client_from_megatron_deepspeed, qkv_from_ours, qkv_to_ours
from megatron_zero.checkpoint.reshape.universal_convert import convert_to_universal
from megatron_zero.checkpoint.reshape.universal_source import SourceCheckpoint
from megatron_zero.checkpoint.storage.safe_pickle import ModelType, safe_load
from megatron_zero.checkpoint.storage.tensor_io import save_file
from megatron_zero.model.params import param_names, param_spec
from megatron_zero.testing.mds_layout import KINDS, write_mds_checkpoint
from megatron_zero.testing.tiny_gpt import tiny_gpt_config


def _full(config):
    g = torch.Generator().manual_seed(0)
    return {n: tuple(torch.randn(param_spec(n, config).full_shape, generator=g) for _ in range(3))
            for n in param_names(config)}


def test_model_type_loads_as_data_and_is_written_under_megatrons_name(tmp_path):
    path = str(tmp_path / "args.pt")
    save_file({"args": argparse.Namespace(model_type=ModelType.encoder_and_decoder)}, path, fsync=False)
    with zipfile.ZipFile(path) as z:
        pickled = z.read(next(n for n in z.namelist() if n.endswith("data.pkl")))
    assert b"megatron.core.enums\nModelType" in pickled
    assert safe_load(path)["args"].model_type is ModelType.encoder_and_decoder


def test_qkv_order_round_trip():
    # 4 heads in 2 groups, head_dim 1: Megatron-DeepSpeed's [q0 q1 q2 q3 | k0 k1 | v0 v1] -> ours per group
    ours = qkv_to_ours(torch.arange(8.0), 4, 2)
    assert ours.tolist() == [0, 1, 4, 6, 2, 3, 5, 7]
    w = torch.randn(24, 5)
    assert torch.equal(qkv_from_ours(qkv_to_ours(w, 4, 4), 4, 4), w)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_reads_megatron_deepspeed_layouts(tmp_path, kind):
    config = tiny_gpt_config()
    full = _full(config)
    tag = write_mds_checkpoint(str(tmp_path), config, full, kind)
    src = SourceCheckpoint(tag, verify=False)
    tp, pp, dp = KINDS[kind]
    assert (src.layout.tp, src.layout.pp, src.layout.dp) == (tp, pp, dp)
    assert sorted(n for n, _ in src.params) == sorted(full)
    for name, stage in src.params:
        with src.stage(stage) as reader:
            for k, key in enumerate(("fp32", "exp_avg", "exp_avg_sq")):
                got, _ = reader.assemble(name, key)
                assert torch.equal(got, full[name][k]), (name, key)
            assert float(reader.step(name)) == 6.0
    client = client_from_megatron_deepspeed(src.head)
    assert client["train_state"] == {"iteration": 6, "consumed_train_samples": 96, "skipped_iterations": 0,
                                     "nan_iterations": 0}
    assert client["lr_scheduler"]["num_steps"] == 6  # Megatron-DeepSpeed counted 96 samples


def test_megatron_deepspeed_checkpoint_converts_to_universal(tmp_path):
    config = tiny_gpt_config()
    full = _full(config)
    tag = write_mds_checkpoint(str(tmp_path / "mds"), config, full, "module_zero1_dp2")
    out = str(tmp_path / "universal")
    convert_to_universal(tag, out, merge_workers=1, progress=False, verify=False)
    name = "3.self_attention.query_key_value.weight"
    record = safe_load(os.path.join(out, "zero", name, "fp32.pt"))
    assert torch.equal(record["param"], full[name][0]) and record["cat_dim"] == 0
