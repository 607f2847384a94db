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
