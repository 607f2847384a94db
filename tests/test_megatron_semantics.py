"""Where Megatron-LM's training semantics are ours, against its formulas (megatron/training/training.py):

- a constant-batch --train-samples run trains `train_samples // global_batch_size` iterations (update_train_iters:
  a partial last batch is dropped), and its schedule decays over --lr-decay-samples, else --train-samples
  (get_optimizer_param_scheduler), with a --lr-warmup-fraction warm-up of fraction x decay steps, not floored;
- a skipped step (an fp16 overflow) does not advance the learning-rate schedule (train_step calls
  opt_param_scheduler.step only when the update succeeded).
The run is pretrain_gpt.py from the command line: fp16 from a loss scale of 2^20, whose first steps overflow."""
import re

import pytest

from megatron_zero.config import from_args
from megatron_zero.arguments import parse_args
from megatron_zero.config.batch_schedule import BatchSchedule
from megatron_zero.optimizer.lr_schedule import build_lr_schedule
from megatron_zero.testing.launch import byte_data, model_flags, pretrain


def megatron_train_iters(train_samples, global_batch_size):
    return train_samples // global_batch_size  # update_train_iters, constant batch size


def megatron_lr(num_steps, max_lr, min_lr, warmup_steps, decay_steps):
    """OptimizerParamScheduler.get_lr, linear decay, init_lr 0."""
    if warmup_steps > 0 and num_steps <= warmup_steps:
        return max_lr * float(num_steps) / float(warmup_steps)
    if num_steps > decay_steps:
        return min_lr
    ratio = float(num_steps - warmup_steps) / float(decay_steps - warmup_steps)
    return min_lr + (1.0 - ratio) * (max_lr - min_lr)


@pytest.mark.parametrize("samples,gbs", [(30, 4), (32, 4), (3, 4), (1001, 8)])
def test_train_samples_round_down_as_megatron(samples, gbs):
    assert BatchSchedule(gbs, 1, 1).train_iters(samples) == megatron_train_iters(samples, gbs)


def test_sample_schedule_lengths_are_megatrons():
    base = model_flags("d", "t", **{"train-iters": None, "train-samples": 30, "global-batch-size": 4,
                                    "lr-warmup-iters": None, "lr-decay-style": "linear", "min-lr": 0.0})
    args = parse_args(base, world_size=1)
    assert args.train_iters == 7 and (args.lr_schedule_warmup, args.lr_schedule_decay) == (0, 30)
    args = parse_args(base + ["--lr-warmup-fraction", "0.1"], world_size=1)
    schedule = build_lr_schedule(from_args(args))
    assert (schedule.warmup_steps, schedule.decay_steps) == (0.1 * 30, 30)  # 3.0 samples, not floored
    assert schedule.lr(2) == pytest.approx(megatron_lr(2, 3e-3, 0.0, 0.1 * 30, 30))


def test_skipped_steps_do_not_advance_the_schedule(tmp_path):
    data = byte_data(tmp_path / "bytes")
    run = pretrain(tmp_path, data, save=None, fp16=True, **{
        "train-iters": None, "train-samples": 30, "lr-warmup-samples": 16, "lr-decay-style": "linear",
        "initial-loss-scale": 2.0 ** 20, "hysteresis": 1})
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    lines = re.findall(r"iteration +(\d+)/ +(\d+) \|.*learning rate: ([0-9.E+-]+) \|.*number of skipped iterations: +"
                       r"(\d+)", run.stdout)
    assert [int(it) for it, *_ in lines] == list(range(1, 8)) and int(lines[0][1]) == 7, run.stdout
    skipped = [int(s) for *_, s in lines]
    assert 0 < skipped[-1] < 7, run.stdout  # some steps overflowed, the others trained
    steps = 0  # samples of the updated steps before each iteration (Megatron's scheduler counts samples)
    for k, (_, _, lr, _) in enumerate(lines):
        assert float(lr) == pytest.approx(megatron_lr(steps, 1e-3, 0.0, 16, 30), rel=1e-6), (k + 1, run.stdout)
        if skipped[k] == (skipped[k - 1] if k else 0):
            steps += 4
