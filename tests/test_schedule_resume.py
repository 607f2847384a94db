"""The schedule check on resume decides as Megatron-Core's OptimizerParamScheduler.load_state_dict does, run
beside it: for each changed flag, ours refuses exactly where its `_check_and_set` asserts (a changed --train-iters
included, even where --lr-decay-iters fixes the decay: Megatron-LM checks the run's length as wd_incr_steps), and
with --override-opt_param-scheduler / --use-checkpoint-opt_param-scheduler every step's rate equals its rate.
(tests/test_schedule_resume_cli.py drives the refusal and the checkpoint's schedule through pretrain_gpt.py.)"""
import contextlib

import pytest
import torch

from megatron_zero import config
from megatron_zero.arguments import parse_args
from megatron_zero.checkpoint.errors import CheckpointError
from megatron_zero.optimizer.lr_schedule import build_lr_schedule
from megatron_zero.training.schedule_resume import resume_schedule
from megatron_zero.testing.flag_checks import BASE, with_flags

mcore_scheduler = pytest.importorskip("megatron.core.optimizer_param_scheduler")

SAVED = dict(lr_decay_style="cosine", lr_warmup_iters=2, min_lr=1e-5)
CHANGES = [{}, {"lr": 2e-3}, {"min_lr": 2e-5}, {"lr_warmup_iters": 3}, {"lr_decay_iters": 8},
           {"lr_decay_style": "linear"}, {"train_iters": 20}, {"train_iters": 20, "lr_decay_iters": 10},
           {"lr_decay_iters": 10}]


def run_args(**changes):
    return parse_args(with_flags(BASE, **{**SAVED, **changes}), world_size=1)


def megatron_core(args, override_opt_param_scheduler=False, use_checkpoint_opt_param_scheduler=False):
    """Megatron-LM's get_optimizer_param_scheduler for an iteration-based run (steps in samples; its flags'
    defaults are False, the class's use_checkpoint default True)."""
    gbs = args.global_batch_size
    decay = args.lr_decay_iters or args.train_iters
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=args.lr)
    return mcore_scheduler.OptimizerParamScheduler(
        opt, init_lr=0.0, max_lr=args.lr, min_lr=args.min_lr, lr_warmup_steps=args.lr_warmup_iters * gbs,
        lr_decay_steps=decay * gbs, lr_decay_style=args.lr_decay_style, start_wd=args.weight_decay,
        end_wd=args.weight_decay, wd_incr_steps=args.train_iters * gbs, wd_incr_style="constant",
        override_opt_param_scheduler=override_opt_param_scheduler,
        use_checkpoint_opt_param_scheduler=use_checkpoint_opt_param_scheduler)


@pytest.mark.parametrize("changes", CHANGES, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()) or "same")
def test_refused_where_megatron_core_refuses(changes):
    saved_args, args = run_args(), run_args(**changes)
    saved = build_lr_schedule(config.from_args(saved_args))
    saved.step(4)
    theirs = megatron_core(saved_args)
    theirs.step(4 * saved_args.global_batch_size)
    try:
        megatron_core(args).load_state_dict(theirs.state_dict())
        refuses = False
    except AssertionError:
        refuses = True
    assert refuses == (changes not in ({}, {"lr_decay_iters": 10})), changes  # 10: --train-iters' value
    with pytest.raises(CheckpointError) if refuses else contextlib.nullcontext() as refusal:
        resume_schedule(build_lr_schedule(config.from_args(args)), saved.state_dict())
    if refuses:
        line = str(refusal.value)
        assert "\n" not in line and "--override-opt_param-scheduler" in line, line
        assert "--use-checkpoint-opt_param-scheduler" in line, line
        for ours_flag, mcore_flag in (("override", "override_opt_param_scheduler"),
                                      ("use_checkpoint", "use_checkpoint_opt_param_scheduler")):
            ours, reference = build_lr_schedule(config.from_args(args)), megatron_core(args, **{mcore_flag: True})
            resume_schedule(ours, saved.state_dict(), **{ours_flag: True})
            reference.load_state_dict(theirs.state_dict())
            for step in range(4, 24):
                reference.num_steps = step * args.global_batch_size
                rate = reference.get_lr(reference.optimizer.param_groups[0])
                assert ours.lr(step) == pytest.approx(rate, rel=1e-12, abs=1e-15), (ours_flag, step)

