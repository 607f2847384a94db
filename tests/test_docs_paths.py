"""Every file the documentation names as evidence exists: the tests, benchmarks, scripts, tools and modules
that README.md, BENCHMARKS.md, docs/ and bench/'s READMEs cite in backquotes (a claim's backing cannot be
renamed away unnoticed)."""
import glob
import os
import re

from megatron_zero.testing.launch import ROOT

DOCS = ["README.md", "BENCHMARKS.md", "bench/README.md", "bench/peers/README.md"] + sorted(
    os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))
CITED = re.compile(r"`((?:tests|bench|scripts|tools|examples|megatron_zero|csrc)/[\w./-]*\w)(?:::\w+)?`?")


def test_every_cited_file_exists():
    missing = []
    for doc in DOCS:
        text = open(os.path.join(ROOT, doc)).read()
        for path in CITED.findall(text):
            if "<" in path or path.endswith("bench_"):  # templates such as bench/bench_<what>.py
                continue
            if not os.path.exists(os.path.join(ROOT, path)):
                missing.append(f"{doc}: {path}")
    assert not missing, "\n".join(missing)
