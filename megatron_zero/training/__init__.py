"""The training loop and its policies: the Trainer and pretrain (trainer.py), its named steps (steps.py),
the stop and exit rules, the step hooks, the learning-rate schedule's resume."""
from ..lazy_exports import lazy_exports

__getattr__ = lazy_exports(__name__, {"pretrain": ".trainer", "Trainer": ".trainer"})
