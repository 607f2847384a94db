"""The learning-rate schedule on resume, as Megatron-LM's OptimizerParamScheduler.load_state_dict decides it.

    resume_schedule(schedule, saved, override=False, use_checkpoint=False)

Each of the schedule's arguments (peak and floor lr, warm-up and decay steps, decay style) is compared with the
checkpoint's: --override-opt_param-scheduler keeps the flags' values, --use-checkpoint-opt_param-scheduler takes
the checkpoint's, and without either a difference is refused in one sentence naming both values and the two
flags (a changed --train-iters silently re-deriving the decay otherwise). The step count always comes from the
checkpoint. A Megatron-DeepSpeed scheduler (it counts samples) gives the step count only.
"""
from __future__ import annotations

from .checkpoint.errors import CheckpointError

# the saved key -> (the schedule's attribute, the flag that sets it)
ARGUMENTS = {"max_lr": ("max_lr", "--lr"), "min_lr": ("min_lr", "--min-lr"),
             "lr_warmup_steps": ("warmup_steps", "--lr-warmup-iters / --lr-warmup-fraction"),
             "lr_decay_steps": ("decay_steps", "--lr-decay-iters (default --train-iters)"),
             "lr_decay_style": ("decay_style", "--lr-decay-style")}


def resume_schedule(schedule, saved: dict, override: bool = False, use_checkpoint: bool = False) -> None:
    """Restore `saved` (the checkpoint's lr_scheduler state) into `schedule`, checking its arguments."""
    if not override and "start_wd" not in saved:  # Megatron-DeepSpeed's counts samples: not comparable
        for key, (attr, flag) in ARGUMENTS.items():
            if key not in saved or not hasattr(schedule, attr):
                continue
            mine, theirs = getattr(schedule, attr), saved[key]
            if mine == theirs:
                continue
            if use_checkpoint:
                setattr(schedule, attr, theirs)
                continue
            raise CheckpointError(
                f"the learning-rate schedule's {key} is {mine} from the flags ({flag}) but {theirs} in the "
                "checkpoint; pass --override-opt_param-scheduler to use the flags' value or "
                "--use-checkpoint-opt_param-scheduler to use the checkpoint's")
    schedule.load_state_dict(saved)
