"""Longest sequence that trains in a fixed memory budget: our pretrain_gpt.py against Megatron-DeepSpeed's.

    bash bench/peers/setup_megatron_deepspeed.sh        # once: MDS tree, venv, shims, shm op (outside the repo)
    .venv/bin/python bench/bench_max_seq_vs_mds.py --mds-dir /work/mds_src \
        --mds-python /work/mds_venv/bin/python [--budget-mib 1536] [--start 1024] [--max-length 65536] \
        [--timeout 600] [--bisect] [--configs ours-full,mds-full,...]

Both sides train the throughput bench's GPT (bench_vs_megatron_deepspeed.py: 4 layers, hidden 256, 8 heads,
RMSNorm, GeLU MLP, learned positions, tied embeddings, fp32, no dropout, Adam, same data and SentencePiece
tokenizer, one thread per rank), here with micro-batch 1, global batch 1 and --max-position-embeddings equal
to the sequence length, on one rank (TP2 for the `-tp2` configurations), 2 iterations a launch (so Adam's
state exists when the second step's peak is reached).

Memory is the peak resident set per rank: the kernel's `ru_maxrss` of the launch's process tree (os.wait4 on
the launcher: the largest of torchrun's agent and its ranks, i.e. the largest rank), so it includes each side's
fixed overhead (Python, torch, DeepSpeed, the model and Adam's state). While a launch runs, every process of
its tree is polled (VmHWM in /proc/<pid>/status); a launch whose process passes the budget is killed then
(it would not fit), which also keeps the machine from being asked for the memory a long plain-attention run
wants. A length *trains in the budget* when its launch finishes both iterations with a finite loss and its
peak stays <= the budget. Per configuration the length doubles from `--start` until a launch misses (over the
budget, failed, or over `--timeout`: a time-out is reported as such, not as a memory result) or
`--max-length` is reached; with `--bisect` one more launch halfway between the longest fit and the first
memory miss. Seconds per iteration are Megatron's "elapsed time per iteration" of iteration 2.
"""
import math
import os
import signal
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_vs_megatron_deepspeed import (ITER_MS, LOSS, MODEL, build_data, check_mds, launch_env,  # noqa: E402
                                         machine, mds_arguments, mds_cmd, ours_cmd, remove_shm_buffers)

ITERS = 2
OURS_FULL = ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]
MDS_FULL = ["--checkpoint-activations", "--deepspeed-activation-checkpointing"]
# name: (side, layout, extra flags); the plain rows are the reference, the others each side's memory settings
CONFIGS = {
    "ours-none": ("ours", "tp1", []),
    "ours-selective": ("ours", "tp1", ["--recompute-granularity", "selective"]),
    "ours-full": ("ours", "tp1", OURS_FULL),
    "mds-none": ("mds", "tp1", []),
    "mds-selective": ("mds", "tp1", ["--recompute-granularity", "selective"]),
    "mds-full": ("mds", "tp1", MDS_FULL),
    "ours-tp2-sp-full": ("ours", "tp2", ["--sequence-parallel"] + OURS_FULL),
    # MDS's --sequence-parallel fails on the CPU (its attention masks a [s/2, s/2] score with the [s, s] mask)
    "mds-tp2-full": ("mds", "tp2", MDS_FULL),
}
DEFAULT_CONFIGS = "ours-none,ours-selective,ours-full,mds-none,mds-full"
PAIRS = (("ours-none", "mds-none"), ("ours-full", "mds-full"), ("ours-tp2-sp-full", "mds-tp2-full"))
NPROC = {"tp1": 1, "tp2": 2}
POLL_S = 0.2


def vmhwm_kib(status_text):
    """The VmHWM (peak resident set, KiB) in the text of a /proc/<pid>/status, or 0 if it has none."""
    for line in status_text.splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    return 0


def parse_log(out):
    """{iteration: (ms, loss or nan)} from a Megatron-style training log (ours and MDS print the same lines)."""
    iters = {}
    for line in out.splitlines():
        m = ITER_MS.search(line)
        if m:
            loss = LOSS.search(line)
            iters[int(m.group(1))] = (float(m.group(2)), float(loss.group(1)) if loss else math.nan)
    return iters


def error_lines(out, keep=6):
    """The last `keep` lines of a log that name an error, leaving out torchrun's own report of the failure."""
    lines = [x for x in out.splitlines() if "rror" in x and "torch/distributed" not in x
             and "ChildFailedError" not in x and "error_file" not in x and "errors.html" not in x]
    return lines[-keep:]


def outcome(exit_code, peak_kib, iters, budget_kib, n_iters=ITERS):
    """'fit', 'over' (peak above the budget), 'timeout' (exit_code None) or 'failed: <why>' for one launch."""
    if peak_kib > budget_kib:
        return "over"
    if exit_code is None:
        return "timeout"
    if exit_code != 0:
        return f"failed: exit {exit_code}"
    if n_iters not in iters:
        return f"failed: {len(iters)} of {n_iters} iteration lines"
    if not math.isfinite(iters[n_iters][1]):
        return "failed: loss not finite"
    return "fit"


def next_length(results, start, max_length, bisect):
    """The next sequence length to launch given {length: outcome} so far, or None when the search is over.

    Doubles from `start` while every launch fits and the length stays <= max_length; then, with `bisect`,
    one launch halfway between the longest fit and the first miss (rounded down to a multiple of 256) when
    that miss was a memory one ('over' or 'failed', not a time-out) and the halfway length is new.
    """
    fits = sorted(n for n, o in results.items() if o == "fit")
    misses = sorted(n for n, o in results.items() if o != "fit")
    if not misses:
        n = fits[-1] * 2 if fits else start
        return n if n <= max_length else None
    bisected = any(n % start or (n // start) & (n // start - 1) for n in results)  # a length off the ladder
    if not bisect or bisected or not fits or results[misses[0]] == "timeout":
        return None
    lo, hi = max(n for n in fits if n < misses[0]), misses[0]
    mid = (lo + hi) // 2 // 256 * 256
    return mid if lo < mid < hi and mid not in results else None


def summary(results):
    """(longest fit or None, first miss after it or None) from {length: outcome}."""
    fits = [n for n, o in results.items() if o == "fit"]
    best = max(fits) if fits else None
    misses = [n for n, o in results.items() if o != "fit" and (best is None or n > best)]
    return best, (min(misses) if misses else None)


def descendants(pid):
    """The pids of every live descendant of `pid` (through /proc/<pid>/task/<tid>/children)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            for tid in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{tid}/children") as f:
                    kids = [int(x) for x in f.read().split()]
                out += kids
                todo += kids
        except OSError:
            continue
    return out


def peak_of(pids):
    """The largest VmHWM (KiB) among `pids` still alive."""
    peak = 0
    for p in pids:
        try:
            with open(f"/proc/{p}/status") as f:
                peak = max(peak, vmhwm_kib(f.read()))
        except OSError:
            pass
    return peak


def launch(cmd, cwd, nproc, ext_dir, timeout, budget_kib, log_path):
    """Run one launch: (exit code or None on time-out, peak RSS KiB of its largest process, seconds, log text).

    Killed (every process of its tree, by pid) when a process passes the budget or the time limit passes.
    """
    t0 = time.monotonic()
    with open(log_path, "w") as log:
        p = subprocess.Popen(cmd, cwd=cwd, env=launch_env(cwd, nproc, ext_dir), stdout=log,
                             stderr=subprocess.STDOUT)
    polled, exit_code = 0, None
    try:
        while True:
            pid, status, usage = os.wait4(p.pid, os.WNOHANG)
            if pid:
                p.returncode = exit_code = os.waitstatus_to_exitcode(status)
                polled = max(polled, usage.ru_maxrss)
                break
            polled = max(polled, peak_of([p.pid] + descendants(p.pid)))
            if polled > budget_kib or time.monotonic() - t0 > timeout:
                for q in [p.pid] + descendants(p.pid):
                    try:
                        os.kill(q, signal.SIGKILL)
                    except OSError:
                        pass
                p.wait()
                break
            time.sleep(POLL_S)
    finally:
        if p.returncode is None:
            p.kill()
            p.wait()
        remove_shm_buffers(cmd)
    with open(log_path) as f:
        out = f.read()
    return exit_code, polled, time.monotonic() - t0, out


def mib(kib):
    return f"{kib / 1024:.0f} MiB"


def search(name, a, data, work):
    """Run one configuration's search; {length: (outcome, peak KiB, s/iter or None)}."""
    side, layout, extra = CONFIGS[name]
    results, rows = {}, {}
    while (n := next_length(results, a.start, a.max_length, a.bisect)) is not None:
        rows[n] = measure_one(side, layout, extra, n, a, data, work, f"{name}_{n}")
        results[n] = rows[n][0]
        print(f"  {name:<17} seq {n:>6}: {describe(rows[n])}", flush=True)
    return rows


def measure_one(side, layout, extra, n, a, data, work, tag):
    """(outcome, peak KiB, s/iter of the last iteration or None) of one launch of `side` at length n."""
    model = {**MODEL, "seq-length": n, "max-position-embeddings": n, "micro-batch-size": 1,
             "global-batch-size": 1}
    cmd, cwd = (ours_cmd(layout, data, ITERS, model, extra) if side == "ours" else
                mds_cmd(layout, data, ITERS, a.mds_dir, a.mds_python, work, model, extra))
    log_path = os.path.join(work, f"{tag}.log")
    exit_code, peak, _, out = launch(cmd, cwd, NPROC[layout], a.torch_extensions_dir, a.timeout,
                                     a.budget_mib * 1024, log_path)
    iters = parse_log(out)
    result = outcome(exit_code, peak, iters, a.budget_mib * 1024)
    if result.startswith("failed"):
        print(f"    {tag}: {result}; the log's error lines:\n" + "\n".join(error_lines(out)), flush=True)
    return result, peak, iters[ITERS][0] / 1e3 if ITERS in iters else None


def describe(row):
    result, peak, sec = row
    if result == "fit":
        return f"fits, peak {mib(peak)}, {sec:.1f} s/iteration"
    if result == "over":
        return f"over the budget (killed at {mib(peak)})" if sec is None else f"over the budget ({mib(peak)})"
    return result if result != "timeout" else f"over the time limit (peak so far {mib(peak)})"


def main():
    ap = mds_arguments(__doc__.split("\n")[0])
    ap.add_argument("--budget-mib", type=int, default=1536, help="peak resident set allowed per rank")
    ap.add_argument("--start", type=int, default=1024, help="first sequence length (then doubled)")
    ap.add_argument("--max-length", type=int, default=65536, help="longest length tried")
    ap.add_argument("--bisect", action="store_true", help="one more launch between the longest fit and the "
                                                          "first memory miss")
    ap.add_argument("--timeout", type=int, default=600, help="seconds a launch may run")
    ap.add_argument("--configs", default=DEFAULT_CONFIGS, help=f"from {', '.join(CONFIGS)}")
    ap.add_argument("--reference-seq", type=int, default=256, help="length of the plain reference launches "
                                                                   "that show each side's fixed overhead")
    a = ap.parse_args()
    names = [x for x in a.configs.split(",") if x]
    for x in names:
        if x not in CONFIGS:
            sys.exit(f"bench: --configs: unknown configuration {x!r}; choose from {', '.join(CONFIGS)}")
    if a.start < 1 or a.max_length < a.start or a.budget_mib < 1:
        sys.exit("bench: --start must be >= 1, --max-length >= --start and --budget-mib >= 1")
    check_mds(a)
    print(f"machine: {machine()}; load average {' '.join(f'{x:.1f}' for x in os.getloadavg())}; budget "
          f"{a.budget_mib} MiB per rank; {ITERS} iterations a launch, micro-batch 1, time limit {a.timeout} s")
    with tempfile.TemporaryDirectory() as work:
        data = build_data(work)
        reference = {}
        for side in ("ours", "mds"):
            reference[side] = measure_one(side, "tp1", [], a.reference_seq, a, data, work, f"{side}_reference")
            print(f"  {side}-none reference seq {a.reference_seq}: {describe(reference[side])}", flush=True)
        rows = {name: search(name, a, data, work) for name in names}
    print(f"\nload average at the end {' '.join(f'{x:.1f}' for x in os.getloadavg())}\n")
    print(f"| config | flags | longest length in {a.budget_mib} MiB | peak RSS there | first length over "
          f"(its RSS or the error) | s/iteration at the longest |")
    print("|---|---|---|---|---|---|")
    for side in ("ours", "mds"):
        result, peak, _ = reference[side]
        print(f"| {side}-none reference | (plain) | seq {a.reference_seq}: {result} | {mib(peak)} | | |")
    longest = {}
    for name in names:
        best, miss = summary({n: r[0] for n, r in rows[name].items()})
        longest[name] = (best, miss is None)
        flags = " ".join(CONFIGS[name][2]) or "(plain)"
        at = rows[name][best] if best else None
        miss_text = f"{miss}: {describe(rows[name][miss])}" if miss else f"none up to {a.max_length}"
        print(f"| {name} | `{flags}` | {best or 'none'} | {mib(at[1]) if at else ''} | {miss_text} | "
              f"{f'{at[2]:.1f}' if at else ''} |")
    print()
    for ours, mds in PAIRS:
        (o, o_capped), (m, m_capped) = longest.get(ours, (None, 0)), longest.get(mds, (None, 0))
        if o and m and not m_capped:  # a capped numerator (no miss up to --max-length) is a lower bound
            print(f"longest length {ours} / {mds}: {o} / {m} = {'>= ' if o_capped else ''}{o / m:.2f}")


if __name__ == "__main__":
    main()
