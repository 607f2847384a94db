"""Shared fixtures: the built-in corpus, built once per test session."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device; skipped, with the reason, where there is none")


@pytest.fixture(scope="session")
def builtin_corpus(tmp_path_factory):
    """(data prefix, tokenizer model) of the built-in pydoc corpus."""
    out = tmp_path_factory.mktemp("corpus")
    subprocess.run([sys.executable, os.path.join(ROOT, "tools", "build_corpus.py"), "--output-dir", str(out)],
                   check=True, capture_output=True)
    return str(out / "pydoc_text_document"), str(out / "tokenizer.model")
