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


def test_run_all_rewrites_a_sections_tables_and_record():
    import pytest

    from run_all import rewrite

    from sections import section
    sec = section("zeropp")
    text = "\n".join([f"## {sec.heading}", "", "Run `zeropp`: 2026-11-01, load 9, code at `0000000`. **Stale**: x.",
                      "words", "", "| a | b |", "|---|---|", "| 1 | 2 |", "", "## Next", "| kept |"])
    printed = "machine: cpu\n| a | b |\n|---|---|\n| 3 | 4 |\n"
    record = "Run `zeropp`: 2026-11-28 08:00 UTC, load 2-3, code at `1234567`. **Current**."
    out = rewrite(text, sec, printed, record).split("\n")
    assert out[2] == record and "| 3 | 4 |" in out and "| 1 | 2 |" not in out and out[-1] == "| kept |"
    assert records("\n".join(out))["zeropp"]["status"] == "Current"
    two = rewrite(text, sec, printed + "\nwords\n" + printed.replace("3 | 4", "5 | 6"), record).split("\n")
    assert "| 3 | 4 |" in two and "| 5 | 6 |" in two and two[-1] == "| kept |"  # printed in another number: all
    logged = "| a | b |\n|---|---|\nlog: a row's setting\n| 7 | 8 |\nlog: the next\n| 9 | 0 |\n"
    one = rewrite(text, sec, logged, record).split("\n")  # log lines between a table's rows: one table still
    assert one[one.index("| a | b |"):one.index("| a | b |") + 4] == ["| a | b |", "|---|---|", "| 7 | 8 |", "| 9 | 0 |"]
    with pytest.raises(SystemExit, match="printed 0 tables"):
        rewrite(text, sec, "no table", record)
