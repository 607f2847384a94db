"""Megatron-DeepSpeed's own checkpoint layouts, both ways, built from the format (no Megatron-DeepSpeed needed).

Reading: the non-pipeline layout (weights nested under module -> language_model, ZeRO-1 DP 2 and ZeRO-0 TP 2)
and the pipeline engine's (PP 2, ZeRO-0) give back exactly the tensors they were written from, in our names
and QKV order; Megatron's ModelType in the args loads as data. Writing: a ZeRO-1 DP 2, a TP 2 and a PP 2 save
with --save-megatron-deepspeed-layout has the structure Megatron-DeepSpeed's loader reads, holds exactly the
state our own layout holds, and resumes in ours to the same weights. Comparisons are exact: every path copies and permutes, none computes.
"""
import argparse
import os
import zipfile

import pytest
import torch

from megatron_zero.checkpoint.megatron_deepspeed import client_from_megatron_deepspeed, qkv_from_ours, qkv_to_ours
from megatron_zero.checkpoint.reshape.universal_convert import convert_to_universal
from megatron_zero.checkpoint.resume import megatron_deepspeed_layout
from megatron_zero.checkpoint.errors import CheckpointError
from megatron_zero.checkpoint.reshape.expert_source import LocalExpertNames
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
    save_file({"args": argparse.Namespace(model_type=ModelType.encoder_or_decoder)}, path, fsync=False)
    with zipfile.ZipFile(path) as z:
        pickled = z.read(next(n for n in z.namelist() if n.endswith("data.pkl")))
    assert b"megatron.core.enums\nModelType" in pickled
    # our stand-in, or megatron-core's own class where a process has imported it (it registers itself with
    # torch's weights-only loader): either way the member, read as data
    loaded = safe_load(path)["args"].model_type
    assert (loaded.name, loaded.value) == ("encoder_or_decoder", 1)


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
    assert megatron_deepspeed_layout(tag, verify=False)  # --load reads it by name, through the reshaping loader
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


def _load(path):
    return safe_load(path)


@pytest.mark.multirank
@pytest.mark.parametrize("tp,pp,stage", [
    (1, 1, 1), (1, 2, 1),
    # ZeRO stage 0 (its optimizer state in mp_rank_*): slow; tests/test_megatron_deepspeed_interop.py resumes it in
    # Megatron-DeepSpeed itself, and test_reads_megatron_deepspeed_layouts reads the same layout from the format
    pytest.param(2, 1, 0, marks=pytest.mark.slow), pytest.param(1, 2, 0, marks=pytest.mark.slow)],
    ids=["dp2-zero1", "pp2-zero1", "tp2-zero0", "pp2-zero0"])
def test_writes_megatron_deepspeed_layouts(tmp_path, tp, pp, stage):
    from megatron_zero.testing.mds_layout import save_both_layouts
    from megatron_zero.testing.multirank import run_ranks

    ours, mds = str(tmp_path / "ours"), str(tmp_path / "mds")
    run_ranks(save_both_layouts, 2, tp, pp, stage, ours, mds)
    tag = os.path.join(mds, "global_step2")
    files = sorted(os.listdir(tag))
    head = _load(os.path.join(tag, "mp_rank_00_model_states.pt"))
    # what Megatron-DeepSpeed's loader reads
    assert ("layer_02-model_00-model_states.pt" in files) == (pp > 1)
    if pp == 1:
        assert sorted(head["module"]["language_model"]) == ["embedding", "encoder"]
        assert "layers.0.self_attention.query_key_value.weight" in head["module"]["language_model"]["encoder"]
    else:
        assert head["module"] is None
    assert isinstance(head["args"], argparse.Namespace) and head["args"].num_key_value_heads == 4
    assert head["args"].consumed_train_samples == 16 and head["tokens"] == 16 * 8
    sched = head["lr_scheduler"]
    assert (sched["num_steps"], sched["lr_warmup_steps"], sched["lr_decay_steps"], sched["wd_incr_steps"]) == (
        16, 8, 80, 80)
    assert {"lr_warmup_tokens", "num_tokens", "lr_decay_tokens", "start_wd", "end_wd", "wd_incr_style"} <= set(sched)
    rng = head["rng_state"][0]
    assert "cuda_rng_state" in rng and torch.is_tensor(rng["rng_tracker_states"]["model-parallel-rng"])
    if pp > 1:  # the pipeline engine's layer files hold the QKV in Megatron-DeepSpeed's order
        ours_layer = _load(os.path.join(ours, "global_step2", "layer_02-model_00-model_states.pt"))
        mds_layer = _load(os.path.join(tag, "layer_02-model_00-model_states.pt"))
        qkv = "self_attention.query_key_value.weight"
        assert torch.equal(mds_layer[qkv], qkv_from_ours(ours_layer[qkv], 4, 4))
    if stage == 0:
        assert head["param_shapes"] is None and not any("optim_states" in f for f in files)
        assert {"wd_mult", "lr_mult"} <= set(head["optimizer"]["param_groups"][1])
    else:
        path = os.path.join(tag, "zero_pp_rank_0_mp_rank_00_optim_states.pt")
        with zipfile.ZipFile(path) as z:
            pickled = z.read(next(n for n in z.namelist() if n.endswith("data.pkl")))
        assert b"deepspeed.utils.tensor_fragment\nfragment_address" in pickled
        assert b"deepspeed.runtime.fp16.loss_scaler\nLossScaler" in pickled
        osd = _load(path)["optimizer_state_dict"]
        word = "language_model.embedding.word_embeddings.weight" if pp == 1 else "tied_modules.embed.word_embeddings.weight"
        assert word in osd["param_slice_mappings"][0]
        assert osd["base_optimizer_state"]["param_groups"][1]["wd_mult"] == 0.0
    # and it holds exactly the state our own layout holds
    a, b = SourceCheckpoint(os.path.join(ours, "global_step2")), SourceCheckpoint(tag)
    assert a.params == b.params
    for name, s in a.params:
        with a.stage(s) as ra, b.stage(s) as rb:
            for key in ("fp32", "exp_avg", "exp_avg_sq"):
                assert torch.equal(ra.assemble(name, key)[0], rb.assemble(name, key)[0]), (name, key)


@pytest.mark.multirank
@pytest.mark.parametrize("kind,tp,pp,stage", [("module_zero1_dp2", 2, 1, 1), ("pipeline_dense_pp2", 1, 1, 2)],
                         ids=["dp2-zero1-to-tp2", "pp2-to-dp2-zero2"])
def test_loads_megatron_deepspeed_at_another_layout(tmp_path, kind, tp, pp, stage):
    from megatron_zero.testing import layout_train
    from megatron_zero.testing.multirank import run_ranks

    config = tiny_gpt_config()
    full = _full(config)
    tag = write_mds_checkpoint(str(tmp_path), config, full, kind, gbs=layout_train.GBS)
    results = run_ranks(layout_train.train, 2, tp, pp, stage, 2, load=tag, load_kind="plain", iters=6)
    loaded = layout_train.full_weights(results, config)
    assert sorted(loaded) == sorted(full)
    for name, tensors in full.items():
        assert torch.equal(loaded[name], tensors[0]), name


def test_deepspeed_engine_expert_names_are_local_to_their_ep_rank():
    """Megatron-DeepSpeed's ZeRO files name experts by their id on the EP rank (DP rank d: EP rank d % EP); a
    global id is found only in the files of its EP rank (Megatron-DeepSpeed itself: test_megatron_deepspeed_moe_interop)."""
    names = LocalExpertNames(4, 2, "mp_rank_00_model_states.pt")
    expert = "3.mlp.deepspeed_moe.experts.deepspeed_experts.{}.dense_h_to_4h.weight"
    assert [names.on_rank(expert.format(e), 1) for e in range(4)] == [None, None, expert.format(0), expert.format(1)]
    assert [names.on_rank(expert.format(e), 2) for e in range(4)] == [expert.format(0), expert.format(1), None, None]
    assert names.on_rank("3.mlp.deepspeed_moe.gate.wg.weight", 1) == "3.mlp.deepspeed_moe.gate.wg.weight"
    with pytest.raises(CheckpointError, match="3 experts over an expert-parallel size of 2"):
        LocalExpertNames(3, 2, "mp_rank_00_model_states.pt")
