"""Checks before the first iteration: the data's token ids against the vocabulary, and a checkpoint's model
settings against the flags (each difference named; settings that may change on resume are not refused)."""
import argparse

import numpy as np
import pytest

from megatron_zero.arguments import parse_args
from megatron_zero.checkpoint.compat import check_checkpoint_compat, disagreements
from megatron_zero.checkpoint.errors import CheckpointError
from megatron_zero.checkpoint.reshape.universal_convert import convert_to_universal
from megatron_zero.data import DataError, token_range
from megatron_zero.data.indexed_dataset import IndexedDataset
from megatron_zero.testing.launch import byte_data, pretrain, tiny_flags


def one_line_error(run):
    assert run.returncode == 2, run.stdout[-2000:] + run.stderr[-2000:]
    assert "Traceback" not in run.stderr and run.stderr.strip().count("\n") == 0, run.stderr
    return run.stderr


def test_token_ids_above_the_vocabulary_are_refused_and_the_maximum_is_cached(tmp_path, monkeypatch):
    ds = IndexedDataset(byte_data(tmp_path / "ok"))
    assert token_range.check_token_ids(ds, 257, str(tmp_path / "cache")) == 256
    bad = IndexedDataset(byte_data(tmp_path / "bad", top=400))
    with pytest.raises(DataError, match=r"bad\.bin holds token id 400 but the tokenizer's vocabulary has 257 ids"):
        token_range.check_token_ids(bad, 257, str(tmp_path / "cache"))
    monkeypatch.setattr(token_range, "scan_max_token_id", lambda *a: pytest.fail("the cached maximum was rescanned"))
    assert token_range.max_token_id(bad, str(tmp_path / "cache")) == 400
    monkeypatch.undo()
    monkeypatch.setattr(token_range, "CHUNK_TOKENS", 7)  # the chunked scan finds the same maximum
    assert token_range.scan_max_token_id(str(tmp_path / "bad.bin"), np.uint16) == 400


def test_pretrain_refuses_data_of_another_tokenizer(tmp_path):
    err = one_line_error(pretrain(tmp_path, byte_data(tmp_path / "wide", top=300)))
    assert "wide.bin holds token id 300" in err and "257 ids" in err


def test_checkpoint_model_settings_are_checked_on_resume(tmp_path):
    data = byte_data(tmp_path / "bytes")
    assert pretrain(tmp_path, data).returncode == 0
    err = one_line_error(pretrain(tmp_path, data, load=tmp_path / "ckpt", **{
        "num-attention-heads": 2, "hidden-size": 64, "seq-length": 8, "layernorm-epsilon": 1e-6, "train-iters": 3}))
    for words in ("--num-attention-heads 4 in the checkpoint vs 2 here", "--hidden-size 32 in the checkpoint vs 64",
                  "--max-position-embeddings 16 in the checkpoint vs 8", "--layernorm-epsilon 1e-05 in the checkpoint vs 1e-06",
                  "--ffn-hidden-size 128 in the checkpoint vs 256"):
        assert words in err, (words, err)
    err = one_line_error(pretrain(tmp_path, data, load=tmp_path / "ckpt", **{
        "tokenizer-type": "NullTokenizer", "vocab-size": 300, "train-iters": 3}))
    assert "vocabulary size 257 in the checkpoint vs 301 here" in err
    # a universal checkpoint records the same settings (its copied model-states file)
    universal = tmp_path / "universal"
    convert_to_universal(str(tmp_path / "ckpt" / "global_step2"), str(universal), merge_workers=1)
    args = parse_args(tiny_flags(tmp_path, data, **{"num-attention-heads": 2}))
    with pytest.raises(CheckpointError, match="--num-attention-heads 4 in the checkpoint vs 2 here"):
        check_checkpoint_compat(str(universal), vars(args), 257, lambda tp: 384)
    # what may change on resume: batch sizes, lr, ZeRO stage, dropout, precision of the run, seed (a changed
    # schedule -- --lr, --train-iters -- with --override-opt_param-scheduler, as Megatron-LM: training/schedule_resume.py)
    run = pretrain(tmp_path, data, load=tmp_path / "ckpt", **{
        "train-iters": 3, "global-batch-size": 8, "lr": 5e-4, "zero-stage": 2, "hidden-dropout": 0.0, "seed": 9,
        "override-opt_param-scheduler": True})
    assert run.returncode == 0, run.stderr[-2000:]
    assert "from iteration 2" in run.stdout


def test_megatron_deepspeed_architecture_switches_are_compared():
    args = argparse.Namespace(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=128,
                              seq_length=16, max_position_embeddings=16, make_vocab_size_divisible_by=128,
                              layernorm_epsilon=1e-5)
    saved = dict(vars(args), swiglu=True, normalization="rmsnorm", padded_vocab_size=512,
                 tensor_model_parallel_size=2, add_bias_linear=True)
    diffs = disagreements({"args": argparse.Namespace(**saved)}, args, 257, lambda tp: 256 * tp)
    assert diffs == ["swiglu True in the checkpoint vs False here",
                     "normalization RMSNorm in the checkpoint vs LayerNorm here"]
    diffs = disagreements({"args": dict(saved, swiglu=False, normalization="LayerNorm", padded_vocab_size=384)},
                          args, 257, lambda tp: 256 * tp)
    assert diffs == ["padded vocabulary size 384 in the checkpoint vs 512 here (from the tokenizer)"]


def test_mixture_of_experts_structure_is_compared_on_resume():
    """A dense checkpoint resumed with MoE layers, another expert count, layer placement or expert width is
    refused in one sentence naming each difference; the router's top-k may change."""
    base = dict(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=128, seq_length=16,
                max_position_embeddings=16, make_vocab_size_divisible_by=128, layernorm_epsilon=1e-5)
    moe = dict(base, num_experts=4, moe_layer_freq=1, moe_layer_offset=0, moe_ffn_hidden_size=64, moe_router_topk=2)

    def diffs(saved, here):
        return disagreements({"args": dict(saved)}, argparse.Namespace(**here), 257, lambda tp: 256 * tp)

    assert diffs(base, moe) == ["--num-experts None (no MoE layers) in the checkpoint vs 4 here"]
    assert diffs(moe, base) == ["--num-experts 4 in the checkpoint vs None (no MoE layers) here"]
    assert diffs(moe, dict(moe, num_experts=8)) == ["--num-experts 4 in the checkpoint vs 8 here"]
    assert diffs(moe, dict(moe, moe_layer_freq=2, moe_ffn_hidden_size=32)) == [
        "--moe-layer-freq 1 in the checkpoint vs 2 here", "--moe-ffn-hidden-size 64 in the checkpoint vs 32 here"]
    assert diffs(moe, dict(moe, moe_router_topk=1)) == []
    # Megatron-DeepSpeed records --num-experts as a list: [1] for a dense model, [4] for four experts
    assert diffs(dict(base, num_experts=[1]), base) == []
    assert diffs(dict(moe, num_experts=[4]), moe) == []
