"""The repository speaks of the product: no tracked file says how its work was organised (numbered issues or
tickets, work sessions, numbered runs in a diary, work branches) or points at files outside the repository.

Each pattern is narrow enough to leave the product's own words alone: "issues 23 all-gathers" (a verb), a
pytest "session" fixture or torchrun's process "session" in code, "run 2 ranks".
"""
import os
import re
import subprocess

from megatron_zero.testing.launch import ROOT

EVERYWHERE = {
    "a numbered issue": re.compile(r"\b[Ii]ssues? #?\d+\b(?!\s+[\w-]+s\b)"),
    "a ticket": re.compile(r"\b[Tt]ickets?\b"),
    "a file outside the repository": re.compile(r"PEERS\.md|\.\./shared/|/work/shared\b"),
    "a work branch": re.compile(r"\bwip/\w"),
}
IN_PROSE = {  # Markdown only: code has legitimate sessions (pytest's fixture scope, a process session)
    "a work session": re.compile(r"\b[Ss]essions?\b"),
    "a numbered run of a diary": re.compile(
        r"(?<![-\w])(?:[Rr]uns?|[Rr]ounds?) [1-9](?:-[1-9])?\b(?!\s*(?:x\b|ranks?\b|GPUs?\b|nodes?\b|processes\b|times\b))"),
    "whose work it was": re.compile(r"\bthis branch\b|\b(?:helper|engineer) `\w+`|\bthe lead(?:'s)? (?:run|ran)\b"),
}
THIS_FILE = os.path.relpath(__file__, ROOT)


def _tracked_text_files():
    listed = subprocess.run(["git", "ls-files", "-z", "-co", "--exclude-standard"], cwd=ROOT, check=True,
                            capture_output=True).stdout.decode().split("\0")
    for rel in filter(None, listed):
        path = os.path.join(ROOT, rel)
        if rel == THIS_FILE or not os.path.isfile(path):
            continue
        with open(path, "rb") as f:
            data = f.read()
        if b"\0" not in data:
            yield rel, data.decode("utf-8", errors="replace")


def test_no_file_speaks_of_how_the_work_was_organised():
    found = []
    for rel, text in _tracked_text_files():
        patterns = {**EVERYWHERE, **(IN_PROSE if rel.endswith(".md") else {})}
        for number, line in enumerate(text.splitlines(), 1):
            found += [f"{rel}:{number}: {what}: {line.strip()[:100]}" for what, p in patterns.items() if p.search(line)]
    assert not found, "\n".join(found)


def test_the_patterns_find_what_they_are_for_and_leave_the_product_alone():
    def flagged(line, prose=True):
        return [w for w, p in {**EVERYWHERE, **(IN_PROSE if prose else {})}.items() if p.search(line)]
    for line in ("## Checkpoint save (issue 9)", "issue 6's acceptance test", "issues 14 and 17", "ticket 3",
                 "see ../shared/PEERS.md", "merged from wip/speed", "the fused kernels (session 5)",
                 "Run 4, on a quiet machine", "rounds 1-3 under load", "(helper `maxseq`)", "on this branch"):
        assert flagged(line), line
    for line in ("ZeRO-3 issues 23 all-gathers a step", "an issue of the format", "run 2 ranks on one host",
                 "3 rounds x 4 timed steps", "@pytest.fixture(scope=\"session\")", "the lead grew to 1.6x",
                 "shared memory (/dev/shm)", "2 rounds of 8 steps", "bench.py --rounds 2 --iters 24"):
        assert not flagged(line, prose=not line.startswith("@")), line
