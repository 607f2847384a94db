"""The real Trainer run in-process on gloo ranks, recording the loss of every iteration, and the flags of the
small GPT the resume tests train with it (dropout on, so RNG state must survive a resume)."""
import torch.distributed as dist

from .launch import model_flags


def train_losses(argv, tp, pp):
    """Train with Megatron flags `argv` at TP x PP on this rank's group; -> the loss of every iteration run."""
    return recorded_training(argv, tp, pp)[1]


def recorded_training(argv, tp=None, pp=None):
    """Train with Megatron flags `argv` on this rank's group, at TP x PP, or (None) at the layout the flags give
    as pretrain_gpt.py builds it (CP and expert parallelism included); -> (the Trainer, each iteration's loss)."""
    from ..arguments import parse_args
    from ..config import from_args
    from ..distributed.topology import build_parallel_state
    from ..training import Trainer

    cfg = from_args(parse_args(argv, world_size=dist.get_world_size()))
    state = build_parallel_state(**cfg.parallel.degrees()) if tp is None else build_parallel_state(tp, pp)
    trainer = Trainer(cfg, state)
    losses = []
    step = trainer.train_step

    def recording_step(micro, *rest):
        out = step(micro, *rest)
        losses.append(float(out[0]))
        return out

    trainer.train_step = recording_step
    trainer.train()
    return trainer, losses


def resume_flags(corpus, tmp_path, tp, pp, zero, **extra):
    """A 2-layer GPT on `corpus` (prefix, tokenizer) for 20 iterations with dropout 0.1; `extra` adds flags."""
    data, tok = corpus
    flags = {"tensor-model-parallel-size": tp, "pipeline-model-parallel-size": pp, "zero-stage": zero,
             "num-layers": 2, "hidden-size": 32, "num-attention-heads": 4, "seq-length": 32,
             "micro-batch-size": 1, "global-batch-size": 8, "train-iters": 20, "eval-iters": 0,
             "hidden-dropout": 0.1, "attention-dropout": 0.1, "data-cache-path": tmp_path / "cache",
             "log-interval": 100}
    flags.update(extra)
    return model_flags(data, tok, **flags)
