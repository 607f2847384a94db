"""BENCHMARKS.md's CPU sections: each has its record line (bench/sections.py), and one recorded **Current** ran
at a commit whose code it measures is today's, comments and docstrings aside; else re-run it with
`bench/run_all.py --section NAME` (or record it **Stale**, naming the change)."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
from sections import BENCHMARKS, SECTIONS, _code, changed_since, records  # noqa: E402


def test_every_section_has_its_record_line():
    with open(BENCHMARKS) as f:
        text = f.read()
    recorded = records(text)
    assert sorted(recorded) == sorted(s.name for s in SECTIONS)
    for s in SECTIONS:
        assert f"## {s.heading}" in text.splitlines(), s.heading
    assert len(text.splitlines()) < 400


def test_a_section_recorded_current_measured_todays_code():
    with open(BENCHMARKS) as f:
        recorded = records(f.read())
    stale = []
    for s in SECTIONS:
        r = recorded[s.name]
        if r["status"] != "Current":
            continue
        changed = changed_since(r["commit"], s.files)
        assert changed is not None, f"{r['commit']} (section {s.name}) is not in this clone's history"
        if changed:
            stale.append(f"{s.name} (code at {r['commit']}; changed since: {', '.join(changed)}): re-run "
                         f"`bench/run_all.py --section {s.name}` or record it **Stale**")
    assert not stale, "\n".join(stale)


def test_comments_and_docstrings_are_not_code():
    before = 'def f(x):\n    """Old words."""\n    return x + 1  # old\n'
    after = 'def f(x):\n    """New words,\n    two lines."""\n    # a comment\n    return x + 1\n'
    assert _code(before) == _code(after)
    assert _code(before) != _code(before.replace("x + 1", "x + 2"))
