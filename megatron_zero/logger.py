"""Megatron-style log lines on stdout and TensorBoard scalars with Megatron's tag names."""
from __future__ import annotations

import math
from typing import Optional


def format_train_line(iteration: int, train_iters: int, consumed: int, ms_per_iter: float, lr: float,
                      global_batch: int, loss: float, loss_scale: float, grad_norm: Optional[float],
                      skipped: int, nan_iters: int, tokens_per_s: float, tflops: float) -> str:
    norm = f"{grad_norm:.3f}" if grad_norm is not None else "n/a"
    return (f" iteration {iteration:8d}/{train_iters:8d} | consumed samples: {consumed:12d} | "
            f"elapsed time per iteration (ms): {ms_per_iter:.1f} | learning rate: {lr:.3E} | "
            f"global batch size: {global_batch:5d} | lm loss: {loss:.6E} | loss scale: {loss_scale:.1f} | "
            f"grad norm: {norm} | number of skipped iterations: {skipped:3d} | "
            f"number of nan iterations: {nan_iters:3d} | tokens per second: {tokens_per_s:.0f} | "
            f"TFLOP/s per rank: {tflops:.4f} |")


def format_eval_line(iteration: int, loss: float, prefix: str = "validation") -> str:
    ppl = math.exp(min(20.0, loss))
    return (f" {prefix} loss at iteration {iteration} | lm loss value: {loss:.6E} | "
            f"lm loss PPL: {ppl:.6E} |")


class TensorBoardLog:
    """Scalars indexed by iteration; a no-op on ranks that do not write."""

    def __init__(self, log_dir: Optional[str], enabled: bool):
        self.writer = None
        if log_dir and enabled:
            from torch.utils.tensorboard import SummaryWriter
            self.writer = SummaryWriter(log_dir=log_dir, max_queue=100)

    def train(self, iteration: int, loss: float, lr: float, grad_norm: Optional[float], loss_scale: float,
              batch_size: int, consumed: int):
        if self.writer is None:
            return
        w = self.writer
        w.add_scalar("lm loss", loss, iteration)
        w.add_scalar("lm loss vs samples", loss, consumed)
        w.add_scalar("learning-rate", lr, iteration)
        if grad_norm is not None:
            w.add_scalar("grad-norm", grad_norm, iteration)
        w.add_scalar("loss-scale", loss_scale, iteration)
        w.add_scalar("batch-size", batch_size, iteration)

    def validation(self, iteration: int, loss: float):
        if self.writer is None:
            return
        self.writer.add_scalar("lm loss validation", loss, iteration)
        self.writer.add_scalar("lm loss validation ppl", math.exp(min(20.0, loss)), iteration)

    def close(self):
        if self.writer is not None:
            self.writer.flush()
            self.writer.close()
