"""The learning-rate schedule on resume, as Megatron-LM's OptimizerParamScheduler.load_state_dict decides it.

    resume_schedule(schedule, saved, override=False, use_checkpoint=False)

Each of the schedule's arguments (peak and floor lr, warm-up and decay steps, decay style, and the run's length,
which Megatron-LM checks as its weight-decay increment steps, --train-iters x the global batch, so that a changed
--train-iters is refused even where --lr-decay-iters fixes the decay) is compared with the checkpoint's:
--override-opt_param-scheduler keeps the flags' values, --use-checkpoint-opt_param-scheduler takes the
checkpoint's, and without either a difference is refused in one sentence naming both values and the two flags.
The step count always comes from the checkpoint. A Megatron-DeepSpeed scheduler (it counts samples) gives the
step count only, as does a checkpoint saved before its key was written.
"""
from __future__ import annotations

from ..checkpoint.errors import CheckpointError

# the saved key (Megatron's) -> (the schedule's attribute, what it is, the flags that set it)
ARGUMENTS = {"max_lr": ("max_lr", "peak learning rate", "--lr"),
             "min_lr": ("min_lr", "minimum learning rate", "--min-lr"),
             "lr_warmup_steps": ("warmup_steps", "warm-up length", "--lr-warmup-iters / --lr-warmup-fraction"),
             "lr_decay_steps": ("decay_steps", "decay length", "--lr-decay-iters, whose default is --train-iters"),
             "lr_decay_style": ("decay_style", "decay style", "--lr-decay-style"),
             "wd_incr_steps": ("train_steps", "run length", "--train-iters / --train-samples")}


def resume_schedule(schedule, saved: dict, override: bool = False, use_checkpoint: bool = False) -> None:
    """Restore `saved` (the checkpoint's lr_scheduler state) into `schedule`, checking its arguments."""
    if not override and "start_wd" not in saved:  # Megatron-DeepSpeed's counts samples: not comparable
        for key, (attr, what, flags) in ARGUMENTS.items():
            if saved.get(key) is None or getattr(schedule, attr, None) is None:
                continue
            mine, theirs = getattr(schedule, attr), saved[key]
            if mine == theirs:
                continue
            if use_checkpoint:
                setattr(schedule, attr, theirs)
                continue
            raise CheckpointError(
                f"the learning-rate schedule's {what} ({key}) is {mine} from the flags ({flags}) but {theirs} in "
                "the checkpoint; pass --override-opt_param-scheduler to use the flags' value or "
                "--use-checkpoint-opt_param-scheduler to use the checkpoint's")
    schedule.load_state_dict(saved)
