"""Host memory of this process, read from /proc (Linux), and its peak while a function runs.

    rss()                               # resident bytes (anonymous + file-backed pages)
    anon_and_rss()                      # (RssAnon, VmRSS): anonymous pages are what a copy costs
    seconds, grown = measured(fn)       # peak growth of rss() during fn(), sampled every 2 ms
    seconds, anon, total = measured(fn, anon_and_rss)
    status_bytes("VmHWM")               # one byte count of /proc/self/status (VmRSS, VmHWM, ...)
    reset_high_water_mark()             # VmHWM back to the resident bytes now (/proc/self/clear_refs 5)

Used by the tests and benches that state a host-memory bound. A 2 ms sampler can miss a spike
shorter than that; the bounds it checks are about buffers that live for a whole save or load.
"""
from __future__ import annotations

import os
import threading
import time


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def status_bytes(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {key}")


def reset_high_water_mark() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def anon_and_rss():
    fields = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("RssAnon:", "VmRSS:")):
                name, value = line.split(":")
                fields[name] = int(value.split()[0]) * 1024
    return fields["RssAnon"], fields["VmRSS"]


def measured(fn, probe=lambda: (rss(),)):
    """(seconds, then the peak extra of each reading of probe()) of fn(); readings sampled every 2 ms."""
    base, stop = probe(), threading.Event()
    peak = list(base)

    def sample():
        while not stop.is_set():
            peak[:] = map(max, peak, probe())
            time.sleep(0.002)

    t = threading.Thread(target=sample, daemon=True)
    t.start()
    start = time.perf_counter()
    try:
        fn()
    finally:
        dt = time.perf_counter() - start
        stop.set()
        t.join()
    peak[:] = map(max, peak, probe())
    return (dt, *(max(0, p - b) for p, b in zip(peak, base)))


# A tool's peak as the kernel counts it (VmHWM), reset once its imports are done, so the number is what the
# work itself held: no sampling, nothing missed. Linux: /proc/self/clear_refs "5" resets the high-water mark.
_TOOL_PEAK = """
import re, runpy, sys
import torch, torch.distributed.checkpoint  # noqa: F401  (imports are not the work)
import megatron_zero.checkpoint.interop.convert, megatron_zero.checkpoint.interop.titan  # noqa: F401
import megatron_zero.checkpoint.interop.torch_dist_write, megatron_zero.checkpoint.interop.to_universal  # noqa: F401
import importlib, os
for name in filter(None, os.environ.get("TOOL_PEAK_IMPORTS", "").split(",")):  # the tool's own, also not the work
    importlib.import_module(name)
def kb(field):
    return int(re.search(field + r":\\s+(\\d+)", open("/proc/self/status").read()).group(1))
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
base = kb("VmRSS")
sys.argv = sys.argv[1:]
try:
    runpy.run_path(sys.argv[0], run_name="__main__")
except SystemExit as e:
    if e.code:
        raise
print("PEAK_GROWTH_KB", kb("VmHWM") - base, file=sys.stderr)
"""


def tool_peak_growth(script: str, *args: str, imports: tuple = ()) -> int:
    """Bytes the tool `script` (run in a fresh interpreter with `args`) held at its peak beyond what it held once
    its imports (and the modules named in `imports`) were done: resident pages, anonymous and file-backed
    (mapped checkpoint files) alike."""
    import subprocess
    import sys
    env = dict(os.environ, TOOL_PEAK_IMPORTS=",".join(imports))
    run = subprocess.run([sys.executable, "-c", _TOOL_PEAK, script, *args], capture_output=True, text=True,
                         timeout=900, env=env)
    if run.returncode or "PEAK_GROWTH_KB" not in run.stderr:
        raise AssertionError(f"{script} failed ({run.returncode}): {run.stderr[-2000:]}")
    return int(run.stderr.rsplit("PEAK_GROWTH_KB", 1)[1].split()[0]) * 1024
