"""Megatron-LM / Megatron-DeepSpeed compatibility flags: each has its effect, or is refused in one sentence."""
import gc
import json
import os

import numpy as np
import pytest

from megatron_zero.config import from_args
from megatron_zero.arguments import parse_args
from megatron_zero.data.builder import build_train_valid_test_datasets
from megatron_zero.data.indexed_dataset import IndexedDataset
from megatron_zero.data.prefetch import BatchPrefetcher
from megatron_zero.data.tokenizers import build_tokenizer
from megatron_zero.optimizer.lr_schedule import build_lr_schedule
from megatron_zero.testing.flag_checks import BASE, refused, with_flags
from megatron_zero.testing.launch import byte_data


def _lrs(args, steps):
    schedule = build_lr_schedule(from_args(args))
    out = []
    for _ in range(steps):
        out.append(schedule.lr())
        schedule.step(args.lr_schedule_per_step)
    return out


def test_token_schedule_is_megatron_deepspeeds():
    # 16 x 32 = 512 tokens a step; warm-up 1024 tokens (2 steps), decay to 4096 tokens (8 steps)
    args = parse_args(with_flags(BASE, lr_warmup_tokens=1024, lr_decay_tokens=4096, lr_decay_style="linear",
                                 min_lr=1e-4), world_size=1)
    assert (args.lr_schedule_unit, args.lr_schedule_per_step) == ("tokens", 512)
    lrs = _lrs(args, 10)
    assert lrs[:3] == pytest.approx([0.0, 5e-4, 1e-3])
    # decay: lr = min + (max - min) (1 - (tokens - warmup) / (decay - warmup))
    assert lrs[5] == pytest.approx(1e-4 + 9e-4 * (1 - (5 * 512 - 1024) / 3072))
    assert lrs[9] == pytest.approx(1e-4)


def test_train_tokens_caps_iterations():
    args = parse_args(with_flags(BASE, train_tokens=512 * 3 + 1), world_size=1)
    assert args.train_iters == 4  # ceil(1537 / 512), below --train-iters 10


def test_sample_schedule_and_warmup_fraction():
    argv = [a for a in BASE if a not in ("--train-iters", "10")] + ["--train-samples", "160"]
    args = parse_args(argv + ["--lr-warmup-samples", "32", "--lr-decay-samples", "128"], world_size=1)
    assert (args.lr_schedule_unit, args.lr_schedule_per_step, args.lr_schedule_warmup) == ("samples", 16, 32)
    assert _lrs(args, 3) == pytest.approx([0.0, 5e-4, 1e-3])
    args = parse_args(with_flags(BASE, lr_warmup_fraction=0.25, lr_decay_iters=8), world_size=1)
    assert (args.lr_schedule_unit, args.lr_schedule_warmup, args.lr_schedule_decay) == ("samples", 32, 128)
    lrs = _lrs(args, 9)
    assert lrs[1] == pytest.approx(5e-4)  # 16 of 32 warm-up samples
    # linear decay (the default style) over samples 32..128: at 80 samples, half way
    assert lrs[5] == pytest.approx(1e-3 * (1 - (80 - 32) / 96)) and lrs[8] == pytest.approx(0.0)


@pytest.mark.parametrize("changes,words", [
    (dict(no_pipeline_parallel=True, pipeline_model_parallel_size=2), ["--no-pipeline-parallel"]),
    (dict(deepspeed_activation_checkpointing=True), ["--deepspeed-activation-checkpointing"]),
    (dict(no_position_embedding=True), ["--no-position-embedding", "rope"]),
    (dict(optimizer="sgd"), ["--optimizer sgd is refused", "Adam"]),
    (dict(ds_sequence_parallel_size=2, context_parallel_size=4), ["--ds-sequence-parallel-size 2", "give one"]),
    (dict(ds_sequence_parallel_size=2, cp_comm_type="all_gather"), ["DeepSpeed-Ulysses", "--cp-comm-type all_gather"]),
    (dict(ckpt_format="zarr"), ["--ckpt-format zarr is refused"]),
    (dict(profile=True), ["--profile", "--tensorboard-dir"]),
    (dict(data_impl="lazy"), ["--data-impl", "mmap"]),
    (dict(lr_warmup_tokens=10, lr_warmup_samples=10), ["tokens", "samples"]),
    (dict(loss_scale=12), ["--loss-scale 12.0", "fp32"]),
])
def test_compat_flags_refused_in_one_sentence(changes, words, capsys):
    err = refused(with_flags(BASE, **changes), 2, capsys)
    for word in words:
        assert word in err, (word, err)


def test_accepted_spellings():
    args = parse_args(with_flags(BASE, attention_backend="local", context_parallel_size=1, kv_channels=16,
                                 ds_sequence_parallel_size=1, ckpt_format="torch", optimizer="adam",
                                 checkpoint_activations=True, deepspeed_activation_checkpointing=True,
                                 no_pipeline_parallel=True, data_impl="mmap"), world_size=1)
    assert args.attention_backend == "unfused" and args.recompute_granularity == "full"
    args = parse_args(BASE + ["--vocab-file", "v.json", "--merge-file", "m.txt"], world_size=1)
    assert args.tokenizer_type == "GPT2BPETokenizer"
    assert parse_args(BASE, world_size=1).tokenizer_type == "SentencePieceTokenizer"


def test_load_equal_to_save_may_not_exist_yet(tmp_path, capsys):
    missing = str(tmp_path / "ckpt")
    assert parse_args(with_flags(BASE, save=missing, load=missing), world_size=1).load == missing
    assert "is not a directory" in refused(with_flags(BASE, save=missing, load=str(tmp_path / "other")), 1, capsys)


def test_deepspeed_json_keys_of_the_scripts(tmp_path, capsys):
    def run(extra):
        cfg = tmp_path / "ds.json"
        cfg.write_text(json.dumps({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2, **extra}))
        return with_flags([a for a in BASE if a not in ("--micro-batch-size", "2", "--global-batch-size", "16")],
                          deepspeed_config=cfg, deepspeed=True)

    curriculum = {"enabled": False, "curriculum_type": "seqlen", "schedule_config": {"difficulty_step": 8}}
    parse_args(run({"prescale_gradients": True, "data_types": {"grad_accum_dtype": "fp32"},
                    "curriculum_learning": curriculum}), world_size=1)
    err = refused(run({"data_types": {"grad_accum_dtype": "bf16"}}), 1, capsys)
    assert "data_types.grad_accum_dtype" in err
    err = refused(run({"curriculum_learning": {**curriculum, "enabled": True}}), 1, capsys)
    assert "curriculum_learning.enabled true" in err and "curriculum_type" not in err


def test_mock_data_is_deterministic_and_in_vocab():
    train, valid, test = build_train_valid_test_datasets(None, "99,1,0", 16, 3, [40, 8, 8], vocab_size=50, mock=True)
    assert test is None and len(train) == 40 and len(valid) == 8
    again = build_train_valid_test_datasets(None, "99,1,0", 16, 3, [40, 8, 8], vocab_size=50, mock=True)[0]
    assert all(np.array_equal(train[i], again[i]) for i in range(40))
    assert train[5].shape == (17,) and train[5].max() < 50 and not np.array_equal(train[5], valid[5])


def test_no_mmap_bin_files_reads_the_same_tokens(tmp_path):
    prefix = byte_data(tmp_path / "bytes")
    mapped, read = IndexedDataset(prefix), IndexedDataset(prefix, mmap_bin=False)
    assert read._bin is None
    for i in range(len(mapped)):
        assert np.array_equal(mapped[i], read[i]) and np.array_equal(mapped.get(i, 3, 5), read.get(i, 3, 5))


def test_num_workers_reads_ahead_the_same_batches():
    calls = []

    def read(idx):
        calls.append(tuple(idx))
        return [i * 10 for i in idx]

    inline, ahead = BatchPrefetcher(read, 0), BatchPrefetcher(read, 2)
    batches = [[[0, 1], [2, 3]], [[4, 5], [6, 7]], [[8, 9], [10, 11]]]
    expected = [inline.get(b) for b in batches]
    calls.clear()
    got = [ahead.get(b, batches[k + 1] if k + 1 < len(batches) else None) for k, b in enumerate(batches)]
    ahead.close()
    assert got == expected
    assert len(calls) == 6  # each micro-batch read once: the next batch's reads were the ones used


def test_step_hooks_manual_gc_and_profile(tmp_path):
    import argparse

    import torch

    from megatron_zero.training.step_hooks import StepHooks

    compat = argparse.Namespace(manual_gc=True, manual_gc_interval=2, empty_unused_memory_level=2, profile=True,
                                profile_ranks=[0], profile_step_start=1, profile_step_end=2)
    hooks = StepHooks(compat, str(tmp_path / "tb"), torch.device("cpu"), rank=0)
    try:
        assert not gc.isenabled()
        for it in range(4):
            hooks.before_step(it)
            torch.ones(8, 8) @ torch.ones(8, 8)
            hooks.after_forward_backward()
            hooks.after_step(it + 1)
        assert hooks.profiler is None
    finally:
        hooks.close()
    assert gc.isenabled()
    traces = [f for _, _, files in os.walk(tmp_path / "tb") for f in files if ".pt.trace.json" in f]
    assert len(traces) == 1


def test_llama2_tokenizer_puts_bos_first(tmp_path):
    import pydoc_data.topics

    from megatron_zero.data.tokenizer_training import train_sentencepiece

    model = train_sentencepiece(list(pydoc_data.topics.topics.values())[:15], str(tmp_path / "sp"), vocab_size=400)
    llama, gpt = build_tokenizer("Llama2Tokenizer", model), build_tokenizer("GPTSentencePieceTokenizer", model)
    text = "The for statement"
    assert llama.tokenize(text) == [llama.sp.bos_id()] + gpt.tokenize(text)
    assert llama.eod == gpt.eod == llama.sp.eos_id()


def test_ds_sequence_parallel_size_is_context_parallel_a2a():
    """Megatron-DeepSpeed's DeepSpeed-Ulysses degree becomes context parallelism with the a2a exchange."""
    args = parse_args(with_flags(BASE, ds_sequence_parallel_size=2), world_size=2)
    assert (args.context_parallel_size, args.cp_comm_type, args.data_parallel_size) == (2, "a2a", 1)
