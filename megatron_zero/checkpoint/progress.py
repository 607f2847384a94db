"""The progress of the long checkpoint tools (convert_checkpoint.py, ds_to_universal.py, zero_to_fp32.py) on stderr.

    bar = Progress("convert_checkpoint", total=48, total_bytes=4 << 30)
    bar.update(1, nbytes)          # per tensor written
    bar.close()                    # ends the bar; the tool then prints its closing summary (with rate(...))

On a terminal: tqdm's bar when tqdm is installed, else one self-overwriting line. Otherwise (a log file, a pipe,
a batch job) a plain line each time another tenth of the work is done, and at least every `every_s` seconds
while it runs:

    convert_checkpoint: 12/48 tensors (25% of the bytes), 1.20/4.80 GiB, 95.3 MiB/s, ETA 0:00:38

The fraction is of the bytes where their total is known (and says so), else of the tensors (or parameters:
`unit`); bytes in MiB below 1 GiB. Off a
terminal, close() adds a last line where the work ended if none was printed there.
"""
from __future__ import annotations

import sys
import time
from typing import Optional


def _clock(seconds: float) -> str:
    s = int(round(seconds))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


def _rate(nbytes: int, seconds: float) -> str:
    return f"{nbytes / 2**20 / seconds:.1f} MiB/s" if seconds > 0 else "- MiB/s"


def rate(nbytes: int, seconds: float) -> str:
    """`nbytes` over `seconds` as the closing summaries print it."""
    return _rate(nbytes, seconds)


class Progress:
    def __init__(self, what: str, total: int, enabled: bool = True, total_bytes: Optional[int] = None,
                 stream=None, every_s: float = 30.0, unit: str = "tensors"):
        self.what, self.total, self.total_bytes, self.enabled, self.unit = what, total, total_bytes, enabled, unit
        self.stream = stream if stream is not None else sys.stderr
        self.done, self.bytes, self.every_s = 0, 0, every_s
        self.start = self.last_print = time.monotonic()
        self.tty = enabled and hasattr(self.stream, "isatty") and self.stream.isatty()
        self._tenth, self._shown, self.bar = 0, -1, None
        if self.tty:
            try:
                from tqdm import tqdm
            except ImportError:
                tqdm = None
            if tqdm is not None:
                unit = dict(total=total_bytes, unit="B", unit_scale=True, unit_divisor=1024) if total_bytes else \
                    dict(total=total, unit=unit)
                self.bar = tqdm(desc=what, file=self.stream, dynamic_ncols=True, **unit)

    @property
    def fraction(self) -> float:
        if self.total_bytes:
            return min(1.0, self.bytes / self.total_bytes)
        return min(1.0, self.done / max(1, self.total))

    def line(self) -> str:
        elapsed = time.monotonic() - self.start
        scale, unit = (2**30, "GiB") if max(self.total_bytes, self.bytes) >= 2**30 else (2**20, "MiB")
        of_bytes = f"/{max(self.total_bytes, self.bytes) / scale:.2f}" if self.total_bytes else ""  # files' headers
        f = self.fraction
        eta = _clock(elapsed * (1 - f) / f) if 0 < f < 1 else ("0:00:00" if f >= 1 else "?")
        share = f"{100 * f:.0f}% of the bytes" if self.total_bytes else f"{100 * f:.0f}%"
        return (f"{self.what}: {self.done}/{self.total} {self.unit} ({share}), {self.bytes / scale:.2f}{of_bytes} "
                f"{unit}, {_rate(self.bytes, elapsed)}, ETA {eta}")

    def update(self, n: int, nbytes: int) -> None:
        self.done += n
        self.bytes += nbytes
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.update(nbytes if self.total_bytes else n)
            return
        if self.tty:
            print("\r" + self.line(), end="", file=self.stream, flush=True)
            return
        tenth, now = int(10 * self.fraction), time.monotonic()
        if tenth > self._tenth or now - self.last_print >= self.every_s:
            self._print(tenth, now)

    def _print(self, tenth: int, now: float) -> None:
        self._tenth, self.last_print, self._shown = tenth, now, self.done
        print(self.line(), file=self.stream, flush=True)

    def close(self) -> None:
        """End the bar; off a terminal, the last line shows where the work ended if no line has yet."""
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        elif self.tty:
            print(file=self.stream, flush=True)
        elif self.enabled and self.done and self._shown != self.done:
            self._print(10, time.monotonic())
