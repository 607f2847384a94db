"""Megatron-style log lines on stdout, and scalars with Megatron's tag names to TensorBoard and wandb.

The train line is Megatron-LM's (timestamp, iteration, consumed samples, time per iteration, model
TFLOP/s per rank, learning rate, batch size, the loss averaged over the iterations since the last
line, loss scale, grad norm, skipped and nan counts) plus tokens per second and MFU (where a peak is known). `ScalarLog`
writes each scalar against the iteration and, for Megatron's "vs samples" tags, against consumed
samples; wandb (--wandb-project) receives the iteration-indexed ones, as Megatron's wandb writer.
"""
from __future__ import annotations

import math
import os
from datetime import datetime
from typing import Optional


def format_train_line(iteration: int, train_iters: int, consumed: int, ms_per_iter: float, lr: float,
                      global_batch: int, loss: float, loss_scale: float, grad_norm: Optional[float],
                      skipped: int, nan_iters: int, tokens_per_s: float, tflops: float,
                      mfu: Optional[float] = None, params_norm: Optional[float] = None,
                      decoupled_lr: Optional[float] = None) -> str:
    norm = f"{grad_norm:.3f}" if grad_norm is not None else "n/a"
    decoupled = f"decoupled learning rate: {decoupled_lr:.6E} | " if decoupled_lr is not None else ""
    line = (f" [{datetime.now().strftime('%Y-%m-%d %H:%M:%S')}] iteration {iteration:8d}/{train_iters:8d} | "
            f"consumed samples: {consumed:12d} | elapsed time per iteration (ms): {ms_per_iter:.1f} | "
            f"throughput per GPU (TFLOP/s/GPU): {tflops:.3f} | learning rate: {lr:.6E} | {decoupled}"
            f"global batch size: {global_batch:5d} | lm loss: {loss:.6E} | loss scale: {loss_scale:.1f} | "
            f"grad norm: {norm} | ")
    if params_norm is not None:
        line += f"params norm: {params_norm:.3f} | "
    line += (f"number of skipped iterations: {skipped:3d} | number of nan iterations: {nan_iters:3d} | "
             f"tokens per second: {tokens_per_s:.0f} | ")
    if mfu is not None:  # without a known peak the field is left out (the start of the run says why once)
        line += f"MFU: {100 * mfu:.2f}% |"
    return line.rstrip(" ")


def format_eval_line(iteration: int, loss: float, prefix: str = "validation") -> str:
    ppl = math.exp(min(20.0, loss))
    return (f" {prefix} loss at iteration {iteration} | lm loss value: {loss:.6E} | "
            f"lm loss PPL: {ppl:.6E} |")


def memory_scalars(device) -> dict:
    """Megatron's memory tags: the allocator's numbers on an accelerator, the process's RSS on the CPU."""
    import torch
    if device.type != "cpu":
        stats = torch.get_device_module(device).memory_stats(device)
        return {"mem-reserved-bytes": stats.get("reserved_bytes.all.current", 0),
                "mem-allocated-bytes": stats.get("allocated_bytes.all.current", 0),
                "mem-allocated-count": stats.get("allocation.all.current", 0),
                "mem-max-allocated-bytes": stats.get("allocated_bytes.all.peak", 0)}
    with open("/proc/self/statm") as f:
        resident_pages = int(f.read().split()[1])
    return {"mem-rss-bytes": resident_pages * os.sysconf("SC_PAGE_SIZE")}


class ScalarLog:
    """TensorBoard (--tensorboard-dir) and wandb (--wandb-project) scalars; a no-op on ranks that do not write."""

    def __init__(self, log, queue_size: int, enabled: bool, run_config=None):
        """`log`: the run's LogConfig (--tensorboard-dir, --wandb-*); `queue_size`: --tensorboard-queue-size;
        `run_config`: the config.Config wandb records (its saved args)."""
        self.writer, self.wandb = None, None
        if not enabled:
            return
        if log.tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter
            self.writer = SummaryWriter(log_dir=log.tensorboard_dir, max_queue=queue_size)
        if log.wandb_project:
            import wandb
            from ..config import saved_args
            os.makedirs(log.wandb_save_dir, exist_ok=True)
            self.wandb = wandb.init(project=log.wandb_project, name=log.wandb_exp_name, dir=log.wandb_save_dir,
                                    config=saved_args(run_config))

    def scalar(self, tag: str, value: float, iteration: int, samples: Optional[int] = None):
        """`tag` at `iteration`, and "`tag` vs samples" at `samples` when given (TensorBoard only)."""
        if self.writer is not None:
            self.writer.add_scalar(tag, value, iteration)
            if samples is not None:
                self.writer.add_scalar(f"{tag} vs samples", value, samples)
        if self.wandb is not None:
            self.wandb.log({tag: value}, step=iteration)

    def close(self):
        if self.writer is not None:
            self.writer.flush()
            self.writer.close()
        if self.wandb is not None:
            self.wandb.finish()
