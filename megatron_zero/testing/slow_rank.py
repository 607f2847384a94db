"""pretrain_gpt.py with one rank made slow on purpose, for the straggler report's tests: run this file as
torchrun's script (same flags as pretrain_gpt.py). With SLOW_RANK=r in the environment, rank r sleeps
SLOW_SECONDS (default 0.1) in each micro-batch's forward step (its compute, not a collective) from step
SLOW_AFTER + 1 on (default 0: from the first)."""
import os
import sys
import time

from megatron_zero.training import trainer as training


def _slowed(make_forward_step, seconds: float, after: int):
    made = [0]

    def make(*args, **kwargs):
        step = make_forward_step(*args, **kwargs)
        made[0] += 1
        if made[0] <= after:
            return step

        def slow_step(*a, **k):
            time.sleep(seconds)
            return step(*a, **k)
        return slow_step
    return make


if __name__ == "__main__":
    if os.environ.get("SLOW_RANK") == os.environ.get("RANK"):
        training.make_forward_step = _slowed(training.make_forward_step, float(os.environ.get("SLOW_SECONDS", "0.1")),
                                             int(os.environ.get("SLOW_AFTER", "0")))
    sys.exit(training.pretrain(sys.argv[1:]))
