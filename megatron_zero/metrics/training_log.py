"""What the training loop reports, and when: the log line, TensorBoard / wandb scalars, the timers.

Every iteration: the learning rate, loss scale, grad norm and batch size go to the scalar writers
(each also "vs samples"); the loss stays on the device (reading it would wait for the step's queued
work). Every --log-interval (and at `flush`, before a checkpoint) the interval's losses come to the host
in one read: each goes to the writers under its own iteration, the finite ones of updated iterations
join the average, and the non-finite ones count as nan iterations. Every --log-interval also:
the averaged line (logger.format_train_line), `iteration-time`, `throughput` (model TFLOP/s per rank,
Megatron's formula), `world-size` (--log-world-size-to-tensorboard), `params-norm` (--log-params-norm,
a collective over the model-parallel and data-parallel groups), the memory tags
(--log-memory-to-tensorboard), the timers' breakdown (--timing-log-level, a collective) and the
straggler report (--log-straggler, a collective: elastic/straggler.py).
Collectives are entered by every rank at the same iterations; only the writer rank prints and writes.
"""
from __future__ import annotations

import math
import time
from typing import Optional

import torch

from .logger import ScalarLog, format_train_line, memory_scalars
from .throughput import mfu, peak_tflops, tflops_per_rank
from .timers import Timers


def architecture_name(config) -> str:
    """What the start-up line calls the model: GPT-2 (the default switches), Llama (RMSNorm, RoPE and SwiGLU;
    grouped-query attention and the rest as they are), else GPT with the switches that differ from GPT-2."""
    llama = config.normalization == "RMSNorm" and config.position_embedding_type == "rope" and config.swiglu
    gqa = config.num_query_groups != config.num_attention_heads
    switches = [config.normalization != "LayerNorm" and config.normalization,
                config.position_embedding_type == "rope" and "RoPE", config.swiglu and "SwiGLU",
                gqa and f"{config.num_query_groups} query groups",
                config.untie_embeddings_and_output_weights and "untied output layer",
                not config.add_bias_linear and "no linear biases"]
    if llama:
        return "Llama" + (f" ({config.num_query_groups} query groups)" if gqa else "")
    switches = [w for w in switches if w]
    return f"GPT ({', '.join(switches)})" if switches else "GPT-2"


class TrainingLog:
    def __init__(self, cfg, world_size: int, flops_per_iteration: float, device, is_writer: bool, print_fn):
        """`cfg`: the run's config.Config (its log section, and the run's length, batch, sequence and dtype);
        `flops_per_iteration`: at --global-batch-size (scaled to each iteration's own global batch)."""
        self.world_size, self.device, self.is_writer, self.print = world_size, device, is_writer, print_fn
        self.log_cfg = cfg.log
        self.train_iters, self.global_batch_size = cfg.training.train_iters, cfg.parallel.global_batch_size
        self.seq_length, self.params_dtype = cfg.model.seq_length, cfg.optimizer.params_dtype
        self.timers = Timers(self.log_cfg.timing_log_level, self.log_cfg.timing_log_option, device)
        self.scalars = ScalarLog(self.log_cfg, cfg.compat.tensorboard_queue_size, is_writer, run_config=cfg)
        self.flops = flops_per_iteration
        self.peak = peak_tflops(device, self.params_dtype, self.log_cfg.peak_tflops)
        self._loss_sum, self._loss_count, self._iters, self._samples = 0.0, 0, 0, 0
        self._pending = []  # (iteration, consumed samples, loss on the device, updated) not yet read
        self.first_nonfinite_loss = None  # (iteration, loss) of the first inf/NaN loss read (training/stop_rules.py)
        self.last_loss = None  # (iteration, loss) of the newest loss read (the run's summary)
        self._last = time.monotonic()
        self.straggler = None  # the --log-straggler report (elastic/straggler.py), set by the trainer

    def start(self):
        """The clock for the first interval starts here (after loading and building the data); without a known
        peak, one line says that MFU is left out of the log lines, and how to get it."""
        if self.peak is None:
            self.print(f"MFU is not reported: no peak TFLOP/s is known for {self.device.type} ({self.params_dtype}); "
                       "give --peak-tflops to get it in every log line")
        self._last = time.monotonic()

    def iteration(self, progress, global_batch: int, loss: torch.Tensor, lr: float, grad_norm, loss_scale: float,
                  updated: bool, params_norm_fn, decoupled_lr: Optional[float] = None):
        """Record one finished iteration of `global_batch` samples (`loss`: a one-element tensor, read at the
        next log line); every --log-interval print the line (params_norm_fn: a collective; `decoupled_lr`: the
        embedding and output layer's, with --decoupled-lr)."""
        log, p, w = self.log_cfg, progress, self.scalars
        it, samples = p.iteration, p.consumed_train_samples
        self._pending.append((it, samples, loss.detach().reshape(1), updated))
        w.scalar("learning-rate", lr, it, samples)
        if grad_norm is not None:
            w.scalar("grad-norm", grad_norm, it, samples)
        w.scalar("loss-scale", loss_scale, it, samples)
        w.scalar("batch-size", global_batch, it, samples)
        self._iters += 1
        self._samples += global_batch
        if it % log.log_interval != 0 and it != self.train_iters:
            return
        self.flush(p)
        elapsed = (time.monotonic() - self._last) / self._iters
        per_iteration = self._samples / self._iters  # samples: the global batch, or its mean where it grows
        tflops = tflops_per_rank(self.flops * per_iteration / self.global_batch_size, elapsed, self.world_size)
        params_norm = params_norm_fn() if log.log_params_norm else None
        timing = self._timing_block(it)
        avg_loss = self._loss_sum / self._loss_count if self._loss_count else float("nan")
        w.scalar("iteration-time", elapsed, it, samples)
        w.scalar("throughput", tflops, it, samples)
        if params_norm is not None:
            w.scalar("params-norm", params_norm, it, samples)
        if log.log_world_size_to_tensorboard:
            w.scalar("world-size", self.world_size, it, samples)
        if log.log_memory_to_tensorboard:
            for tag, value in memory_scalars(self.device).items():
                w.scalar(tag, value, it, samples)
        self.print(format_train_line(it, self.train_iters, samples, elapsed * 1e3, lr, global_batch, avg_loss,
                                     loss_scale, grad_norm, p.skipped_iterations, p.nan_iterations,
                                     per_iteration * self.seq_length / elapsed, tflops, mfu(tflops, self.peak),
                                     params_norm, decoupled_lr))
        if timing:
            self.print(timing)
        report = self.straggler.line() if self.straggler is not None else None  # a collective
        if report:
            self.print(report)
        self._loss_sum, self._loss_count, self._iters, self._samples = 0.0, 0, 0, 0
        self._last = time.monotonic()

    def flush(self, progress) -> None:
        """Read the losses recorded since the last flush (one host read): write each, add the finite ones
        of updated iterations to the average, count the non-finite ones in progress.nan_iterations."""
        if not self._pending:
            return
        values = torch.cat([loss for _, _, loss, _ in self._pending]).tolist()
        self.last_loss = (self._pending[-1][0], values[-1])
        for (it, samples, _, updated), loss in zip(self._pending, values):
            self.scalars.scalar("lm loss", loss, it, samples)
            if loss != loss:
                progress.nan_iterations += 1
            if not math.isfinite(loss) and self.first_nonfinite_loss is None:
                self.first_nonfinite_loss = (it, loss)
            if updated and math.isfinite(loss):
                self._loss_sum += loss
                self._loss_count += 1
        self._pending = []

    def _timing_block(self, iteration: int) -> str:
        """The timers' text (collective); backward-compute is what forward-backward leaves after forward and p2p."""
        t = self.timers
        if t.log_level >= 2:
            fb, fwd, p2p = (t(n, 1 if n == "forward-backward" else 2).elapsed_s
                            for n in ("forward-backward", "forward-compute", "pipeline-p2p"))
            t("backward-compute", 2).add(max(0.0, fb - fwd - p2p))
        text, max_ms = t.report(normalizer=self._iters)
        if self.log_cfg.log_timers_to_tensorboard:
            for name, ms in max_ms.items():
                self.scalars.scalar(f"{name}-time", ms, iteration)
        return text

    def close(self):
        self.scalars.close()
