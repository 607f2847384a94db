"""--rampup-batch-size and --step-batch-size-schedule: the global batch of every iteration against Megatron-LM's
calculators (transcribed below from megatron/core/num_microbatches_calculator.py: RampupBatchsize... before
its removal in 532ad926b4, StepBatchsize... at d98e8a64dd) and its iteration count of a --train-samples run
(megatron/training/training.py update_train_iters); the sampler's split of growing batches; the learning-rate
schedule counting samples; the values Megatron refuses, refused in one sentence each."""
import pytest

from megatron_zero.config import from_args
from megatron_zero.arguments import ArgumentError, parse_command_line, validate_args
from megatron_zero.config.batch_schedule import BatchSchedule, parse_step_schedule
from megatron_zero.config.compat import lr_increment
from megatron_zero.data import GlobalBatchSampler
from megatron_zero.optimizer.lr_schedule import build_lr_schedule


def megatron_rampup(consumed, final, start, increment, samples):
    """RampupBatchsizeNumMicroBatchesCalculator.update: the current global batch size."""
    per_increment = samples / ((final - start) // increment)
    if consumed > samples:
        return final
    return start + int(consumed / per_increment) * increment


def megatron_step(consumed, schedule):
    """StepBatchsizeNumMicroBatchesCalculator._get_batch_size_for_samples."""
    size = schedule[0][1]
    for threshold, bs in schedule:
        if consumed >= threshold:
            size = bs
        else:
            break
    return size


def megatron_rampup_train_iters(train_samples, gbs_at, ramp_samples, final):
    iterations = consumed = 0
    while consumed <= ramp_samples and consumed <= train_samples:
        consumed += gbs_at(consumed)
        iterations += 1
    if train_samples > consumed:
        iterations += (train_samples - consumed) // final
    return iterations


def megatron_step_train_iters(train_samples, gbs_at):
    iterations = consumed = 0
    while consumed < train_samples:
        consumed += gbs_at(consumed)
        iterations += 1
    return iterations


@pytest.mark.parametrize("final,start,increment,samples", [
    (1024, 16, 8, 300000),   # Megatron-LM's --help example
    (1536, 16, 16, 5859375),  # the GPT-3 175B script before --step-batch-size-schedule
    (64, 4, 12, 1000),        # samples per increment not a whole number (1000 / 5)
    (32, 8, 8, 7),            # fewer ramp-up samples than increments
])
def test_rampup_batch_per_iteration_is_megatrons(final, start, increment, samples):
    plan = BatchSchedule(final, 1, 1, rampup=(start, increment, samples))
    consumed = 0
    for size in plan.sizes(0, plan.train_iters(samples) + 1):  # through the ramp and one final batch
        assert size == megatron_rampup(consumed, final, start, increment, samples), consumed
        consumed += size
    assert size == final
    for train_samples in (samples // 3, samples, samples + 5 * final + 3):
        assert plan.train_iters(train_samples) == megatron_rampup_train_iters(
            train_samples, lambda c: megatron_rampup(c, final, start, increment, samples), samples, final)


def test_step_schedule_per_iteration_is_megatrons():
    """The GPT-3 175B script's schedule at its --seq-length 2048: thresholds in tokens, as samples."""
    text, seq = "0:16 2.4B:320 4.8B:624 7.2B:928 9.6B:1232 12B:1536", 2048
    entries = parse_step_schedule(text, seq)
    assert entries == ((0, 16), (1171875, 320), (2343750, 624), (3515625, 928), (4687500, 1232), (5859375, 1536))
    plan = BatchSchedule(1536, 1, 8, steps=entries)
    consumed = 0
    for size in plan.sizes(0, 80000):
        assert size == megatron_step(consumed, entries)
        consumed += size
    assert plan.reached(500000) == {16, 320, 624, 928, 1232, 1536}
    for train_samples in (1000, 1171875, 6 * 10 ** 6):
        assert plan.train_iters(train_samples) == megatron_step_train_iters(
            train_samples, lambda c: megatron_step(c, entries))
    assert plan.num_micro_batches(0) == 2 and plan.num_micro_batches(6 * 10 ** 6) == 192
    assert parse_step_schedule("0:4, 1k:8", 10) == ((0, 4), (100, 8))  # commas, lower-case suffix


def test_sampler_splits_each_growing_batch_over_dp_ranks():
    plan = BatchSchedule(8, 1, 2, rampup=(2, 2, 12))
    per_rank = [list(GlobalBatchSampler(40, 0, 1, 8, r, 2, batch_size_at=plan.global_batch_size)) for r in range(2)]
    assert len(per_rank[0]) == sum(s // 2 for s in [2, 2, 4, 6, 8, 8, 8]) == 19  # 7 whole batches of 40 samples
    read = sorted(i for rank in per_rank for micro in rank for i in micro)
    assert read == list(range(38))  # each sample once, in the batches' order: [0,2) [2,4) [4,8) [8,14) ...
    assert per_rank[0][:4] == [[0], [2], [4], [6]] and per_rank[1][:4] == [[1], [3], [5], [7]]
    resumed = GlobalBatchSampler(40, 8, 1, 8, 0, 2, batch_size_at=plan.global_batch_size)
    assert list(resumed)[:3] == [[8], [10], [12]]  # from consumed samples 8: the batch of 6


def _args(extra, world=1):
    argv = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
            "--micro-batch-size", "1", "--lr", "1e-3", "--tokenizer-type", "NullTokenizer", "--vocab-size", "64",
            "--mock-data"] + extra
    return validate_args(parse_command_line(argv), world)


def test_lr_schedule_counts_samples_during_rampup():
    args = _args(["--global-batch-size", "8", "--rampup-batch-size", "2", "2", "12", "--train-samples", "40",
                  "--lr-warmup-samples", "10", "--lr-decay-samples", "40"])
    assert args.train_iters == 7 and args.lr_schedule_unit == "samples"
    schedule, consumed = build_lr_schedule(from_args(args)), 0
    for size in args.batch_schedule.sizes(0, 3):  # 2, 2, 4 samples: warm-up is 10 samples long
        schedule.step(lr_increment(args.lr_schedule_unit, size, args.seq_length))
        consumed += size
    assert schedule.num_steps == consumed == 8 and schedule.lr() == pytest.approx(1e-3 * 8 / 10)
    args = _args(["--step-batch-size-schedule", "0:2", "64:8", "--train-iters", "6", "--lr-warmup-iters", "1"])
    assert args.global_batch_size == 8 and args.lr_schedule_unit == "samples"  # Megatron: iters x batch in samples
    assert (args.lr_schedule_warmup, args.lr_schedule_decay) == (8, 48)


@pytest.mark.parametrize("extra,world,sentence", [
    (["--global-batch-size", "8", "--rampup-batch-size", "2", "4", "12", "--train-samples", "40"], 1,
     "--rampup-batch-size 2 4 12: the increment must divide --global-batch-size 8 minus the start batch size 2"),
    (["--global-batch-size", "8", "--rampup-batch-size", "8", "2", "12", "--train-samples", "40"], 1,
     "which must be smaller than it"),
    (["--global-batch-size", "8", "--rampup-batch-size", "2", "2", "12", "--train-iters", "5"], 1,
     "ramps a sample-based run, as in Megatron-LM; give --train-samples"),
    (["--global-batch-size", "8", "--rampup-batch-size", "2", "2", "12", "--train-samples", "40"], 4,
     "--rampup-batch-size reaches a global batch of 2, not a multiple of --micro-batch-size 1 x data-parallel "
     "size 4"),
    (["--global-batch-size", "8", "--rampup-batch-size", "0", "2", "12", "--train-samples", "40"], 1,
     "must be positive"),
    (["--global-batch-size", "16", "--step-batch-size-schedule", "0:4 64:8", "--train-iters", "5"], 1,
     "--global-batch-size 16 differs from the last batch size 8 of --step-batch-size-schedule"),
    (["--step-batch-size-schedule", "16:4 64:8", "--train-iters", "5"], 1, "must start with an entry at threshold 0"),
    (["--step-batch-size-schedule", "0:8 64:4", "--train-iters", "5"], 1, "the batch size must not shrink"),
    (["--step-batch-size-schedule", "0:4 8:8", "--train-iters", "5"], 1, "strictly increasing in samples"),
    (["--step-batch-size-schedule", "0:x4", "--train-iters", "5"], 1, "is not a number"),
    (["--step-batch-size-schedule", "0:4", "--rampup-batch-size", "2", "2", "12", "--train-samples", "40"], 1,
     "--rampup-batch-size and --step-batch-size-schedule both say how the global batch grows"),
    (["--step-batch-size-schedule", "0:3 64:8", "--train-iters", "5", "--pipeline-model-parallel-size", "2",
      "--num-layers", "4", "--num-layers-per-virtual-pipeline-stage", "1"], 2,
     "--step-batch-size-schedule reaches a global batch of 3, 3 micro-batches per step, where "
     "--pipeline-model-parallel-size 2 needs a multiple of 2"),
    (["--step-batch-size-schedule", "0:2 64:8", "--train-iters", "5", "--save-megatron-deepspeed-layout", "--save",
      "/tmp"], 1, "--save-megatron-deepspeed-layout writes the learning-rate schedule from a constant global batch"),
    (["--step-batch-size-schedule", "0:1 64:8", "--train-iters", "5", "--pipeline-model-parallel-size", "2"], 2,
     "reaches a global batch of 1, 1 micro-batches per step, where --pipeline-model-parallel-size 2 needs at least 2"),
])
def test_refused_in_one_sentence(extra, world, sentence):
    with pytest.raises(ArgumentError) as err:
        _args(extra, world)
    assert sentence in str(err.value) and len(str(err.value).splitlines()) == 1, str(err.value)
