"""Re-run BENCHMARKS.md's CPU sections with their recorded arguments and rewrite each one's tables and record line
(date, load, commit: bench/sections.py says which line).

    .venv/bin/python bench/run_all.py --list                       the sections, their commands and whether current
    .venv/bin/python bench/run_all.py --section zero-memory        one section (repeat the flag for more)
    .venv/bin/python bench/run_all.py --bytes                      every section whose numbers are bytes, counts or
                                                                   peak memory (a loaded machine will do)
    .venv/bin/python bench/run_all.py --timing --mds-dir DIR --mds-python PY
                                                                   every timed section (a quiet machine)
    ... --dry-run                                                  print the commands, run and write nothing

The load is /proc/loadavg's 1-minute figure before and after the section's commands. A section whose bench
prints its tables (`|` rows) gets them in place of its own, in order (printed in another number: all of them where
its first one was); one that prints a block gets its ``` block replaced; one whose numbers sit in its prose
("none") gets its record line only, and the output is printed to copy from. A bench that fails writes nothing.
"""
from __future__ import annotations

import argparse
import datetime
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sections import BENCHMARKS, PEER, RECORD, ROOT, SECTIONS, changed_since, records, section  # noqa: E402


def _load() -> str:
    with open("/proc/loadavg") as f:
        return f.read().split()[0]


def _argv(command, peer: dict):
    out = []
    for token in command:
        out.append(peer.get(token, token) if token in PEER[1::2] else token)
    return [sys.executable, os.path.join(ROOT, "bench", out[0])] + out[1:]


def _is_header(lines, i) -> bool:
    return lines[i].startswith("|") and i + 1 < len(lines) and lines[i + 1].startswith("|---")


def _tables(lines):
    """The `|` tables of printed lines, each a list of lines. A table's rows printed between other lines (a bench's
    log lines between its rows) stay one table: a table ends only where another header (a row above `|---`) or
    the end comes."""
    tables, current = [], []
    for i, line in enumerate(lines):
        if not line.startswith("|"):
            continue
        if _is_header(lines, i) and current:
            tables.append(current)
            current = []
        current.append(line.rstrip())
    return tables + [current] if current else tables


def rewrite(text: str, sec, stdout: str, record: str) -> str:
    """BENCHMARKS.md's text with `sec`'s record line and printed tables (or block) replaced."""
    lines = text.split("\n")
    start = lines.index(f"## {sec.heading}")
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
    body = lines[start + 1:end]
    where = [i for i, line in enumerate(body) if RECORD.match(line)]
    if not where:
        raise SystemExit(f"BENCHMARKS.md's section {sec.heading!r} has no record line (bench/sections.py)")
    body[where[0]] = record
    printed = stdout.splitlines()
    if sec.printed == "tables":
        new, old = _tables(printed), _tables(body)
        new = [new[k] for k in sec.keep] if sec.keep is not None and len(new) > max(sec.keep) else new
        if not new or not old:
            raise SystemExit(f"{sec.name}: the bench printed {len(new)} tables, the section has {len(old)}; "
                             "nothing written")
        if len(new) != len(old):  # the tables as printed, all where the section's first one was
            new = [sum(([""] * bool(k) + t for k, t in enumerate(new)), [])] + [[]] * (len(old) - 1)
        out, k, i = [], 0, 0
        while i < len(body):
            if body[i].startswith("|"):
                out += new[k]
                k += 1
                while i < len(body) and body[i].startswith("|"):
                    i += 1
            else:
                out.append(body[i])
                i += 1
        body = out
    elif sec.printed == "block":
        first = body.index("```")
        last = body.index("```", first + 1)
        kept = [line for line in printed if line.strip() and not line.startswith(("machine", "#"))]
        body = body[:first + 1] + kept + body[last:]
    return "\n".join(lines[:start + 1] + body + lines[end:])


def run(sec, peer: dict, dry_run: bool) -> None:
    env = {**os.environ, "PYTHONPATH": ROOT, **dict(sec.env)}
    commands = [_argv(c, peer) for c in sec.commands]
    for c in commands:
        print(f"[{sec.name}] $ {' '.join(c)}", flush=True)
    if dry_run:
        return
    before = _load()
    stdout = ""
    for c in commands:
        done = subprocess.run(c, cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
        print(done.stdout, flush=True)
        if done.returncode != 0:
            raise SystemExit(f"[{sec.name}] {' '.join(c)} exited {done.returncode}; BENCHMARKS.md left as it was")
        stdout += done.stdout
    commit = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    dirty = changed_since(commit, sec.files)
    if dirty:
        print(f"[{sec.name}] note: {', '.join(dirty)} differ from {commit} (uncommitted): the record names {commit}")
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    record = f"Run `{sec.name}`: {when}, load {before}-{_load()}, code at `{commit}`. **Current**."
    with open(BENCHMARKS) as f:
        text = rewrite(f.read(), sec, stdout, record)  # raises, writing nothing, when the tables do not fit
    with open(BENCHMARKS, "w") as f:
        f.write(text)
    if sec.printed == "none":
        print(f"[{sec.name}] its numbers are in the section's prose: copy them from the output above")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--section", action="append", default=[], help="a section's name (--list); repeatable")
    p.add_argument("--bytes", action="store_true", help="every section of bytes, counts or peak memory")
    p.add_argument("--timing", action="store_true", help="every timed section")
    p.add_argument("--list", action="store_true", help="the sections, their commands and record")
    p.add_argument("--dry-run", action="store_true", help="print the commands; run and write nothing")
    p.add_argument("--mds-dir", default="DIR", help="Megatron-DeepSpeed's checkout (bench/peers/)")
    p.add_argument("--mds-python", default="PY", help="the python that runs it")
    a = p.parse_args(argv)
    with open(BENCHMARKS) as f:
        recorded = records(f.read())
    if a.list:
        for s in SECTIONS:
            r = recorded.get(s.name, {})
            changed = changed_since(r["commit"], s.files) if r else None
            state = f"{r.get('status', 'no record')} at {r.get('commit')}" + (
                f", changed since: {', '.join(changed)}" if changed else "")
            print(f"{s.name:<20} {'timing' if s.timing else 'bytes':<7} {state}")
        return 0
    try:
        chosen = [section(n) for n in a.section]
    except KeyError as e:
        p.error(str(e.args[0]))
    chosen += [s for s in SECTIONS if (a.bytes and not s.timing) or (a.timing and s.timing)]
    if not chosen:
        p.error("name a --section, or --bytes or --timing (--list shows them)")
    peer = {"DIR": a.mds_dir, "PY": a.mds_python}
    for s in chosen:
        if any(t in PEER for c in s.commands for t in c) and "DIR" in (a.mds_dir, a.mds_python) and not a.dry_run:
            p.error(f"section {s.name} runs Megatron-DeepSpeed: give --mds-dir and --mds-python "
                    "(bash bench/peers/setup_megatron_deepspeed.sh prints them)")
        run(s, peer, a.dry_run)
    return 0


if __name__ == "__main__":
    sys.exit(main())
