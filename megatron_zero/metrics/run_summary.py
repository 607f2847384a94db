"""The line a run ends with: what it trained, how fast, where it left its checkpoint and its losses.

    training done: iterations 0 to 8 (8 run, 1 skipped), 4096 tokens in 3.2 s (1280 tokens/s, MFU 31.20%);
    final lm loss 5.123E+00 (iteration 8 alone; a log line averages its interval); last validation lm loss
    5.201E+00 (iteration 6); last checkpoint ckpt/global_step8

The clock and the counts start when the loop does (after building and loading), so the time is the loop's
wall time with its evaluations and saves, and tokens per second the rate a person waited for. MFU is that
rate's model FLOPs per rank over the peak (throughput.py), and only where a peak is known; the validation
loss only where the run evaluated. Host arithmetic only: the values come from what the loop already read.
"""
from __future__ import annotations

import time
from typing import Optional, Tuple


class RunSummary:
    def __init__(self, progress, seq_length: int, flops_per_sample: float, world_size: int,
                 peak_tflops: Optional[float]):
        self.iteration, self.samples, self.skipped = (progress.iteration, progress.consumed_train_samples,
                                                      progress.skipped_iterations)
        self.seq_length, self.flops_per_sample = seq_length, flops_per_sample
        self.world_size, self.peak = world_size, peak_tflops
        self.validation: Optional[Tuple[int, float]] = None
        self.start = time.monotonic()

    def validated(self, iteration: int, loss: float) -> None:
        self.validation = (iteration, loss)

    def line(self, progress, final_loss: Optional[Tuple[int, float]], last_checkpoint: Optional[str]) -> str:
        """`final_loss`: (iteration, lm loss) of the last iteration read; `last_checkpoint`: the newest saved or
        loaded (None: none)."""
        seconds = max(time.monotonic() - self.start, 1e-9)
        samples = progress.consumed_train_samples - self.samples
        tokens = samples * self.seq_length
        rate = [f"{tokens / seconds:.0f} tokens/s"]
        if self.peak:
            tflops = self.flops_per_sample * samples / seconds / self.world_size / 1e12
            rate.append(f"MFU {100 * tflops / self.peak:.2f}%")
        run = progress.iteration - self.iteration
        skipped = progress.skipped_iterations - self.skipped
        parts = [f"training done: iterations {self.iteration} to {progress.iteration} ({run} run"
                 + (f", {skipped} skipped" if skipped else "") + f"), {tokens} tokens in {seconds:.1f} s "
                 f"({', '.join(rate)})"]
        if final_loss is not None:
            parts.append(f"final lm loss {final_loss[1]:.6E} (iteration {final_loss[0]} alone; a log line averages "
                         "its interval)")
        if self.validation is not None:
            parts.append(f"last validation lm loss {self.validation[1]:.6E} (iteration {self.validation[0]})")
        parts.append(f"last checkpoint {last_checkpoint}" if last_checkpoint else "no checkpoint saved")
        return "; ".join(parts)
