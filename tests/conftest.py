"""Shared fixtures (the built-in corpus, built once per session) and the markers' meaning.

Markers (registered in pyproject.toml): `multirank` is set here on every test of a module that spawns
ranks (it binds `run_ranks` or defines a `torchrun` launcher), so `-m "not multirank"` runs the
single-process tests alone; `gpu` tests are skipped, with the reason, where torch sees no CUDA device, unless
MEGATRON_ZERO_TEST_DEVICE names another device (`cpu`): then they run their logic there (gloo for NCCL, the CPU
kernels for the CUDA ones), and only a test about CUDA itself (its kernels, streams, pinned memory: the `cuda_device`
fixture, or its own check) skips, with the reason;
`slurm` tests skip themselves when no cluster can be set up (tests/test_slurm.py); `slow` tests
(scripts/test.sh leaves them out unless given --all or -m) each name the default-run test that covers their claim.
"""
import os
import subprocess
import sys

import pytest
import torch

from slow_cases import SLOW_CASES

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOURCES = [os.path.join(ROOT, d) for d in ("megatron_zero", "tests", "tools")] + [os.path.join(ROOT, "pretrain_gpt.py")]


def pytest_sessionstart(session):
    from megatron_zero.testing.source_changes import snapshot

    session.config._sources_at_start = snapshot(*SOURCES)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failing test's report names the source files changed since the session started (ranks and
    subprocesses import them from disk; megatron_zero/testing/source_changes.py says why that matters)."""
    outcome = yield
    report = outcome.get_result()
    before = getattr(item.config, "_sources_at_start", None)
    if report.failed and before is not None:
        from megatron_zero.testing.source_changes import changed_since

        changed = changed_since(before, *SOURCES)
        if changed:
            report.sections.append(("source files changed during the session", "\n".join(
                [f"{len(changed)} file(s) changed after the session started; the ranks and subprocesses this test "
                 "started may have run another version of the code than the pytest process:"] +
                [os.path.relpath(p, ROOT) for p in changed[:20]])))


def pytest_collection_modifyitems(config, items):
    forced = os.environ.get("MEGATRON_ZERO_TEST_DEVICE")
    no_cuda = None if torch.cuda.is_available() or forced else \
        pytest.mark.skip(reason=f"needs a CUDA device; torch {torch.__version__} sees none "
                                "(MEGATRON_ZERO_TEST_DEVICE=cpu runs the tier's logic on the CPU)")
    for item in items:
        if item.nodeid in SLOW_CASES:  # tests/slow_cases.py: the slow tier's cases, each naming its default cover
            item.add_marker(pytest.mark.slow)
        names = vars(item.module) if item.module is not None else {}
        if "run_ranks" in names or "torchrun" in names:
            item.add_marker(pytest.mark.multirank)
        if no_cuda is not None and item.get_closest_marker("gpu") is not None:
            item.add_marker(no_cuda)


@pytest.fixture(scope="session")
def builtin_corpus(tmp_path_factory):
    """(data prefix, tokenizer model) of the built-in pydoc corpus."""
    out = tmp_path_factory.mktemp("corpus")
    subprocess.run([sys.executable, os.path.join(ROOT, "tools", "build_corpus.py"), "--output-dir", str(out)],
                   check=True, capture_output=True)
    return str(out / "pydoc_text_document"), str(out / "tokenizer.model")


@pytest.fixture
def cuda_device():
    """cuda:0 for a test about CUDA itself; skipped, with the reason, where torch sees no CUDA device (also under
    MEGATRON_ZERO_TEST_DEVICE=cpu, which runs the rest of the GPU tier's logic on the CPU)."""
    if not torch.cuda.is_available():
        pytest.skip(f"about CUDA itself (streams, pinned memory, CUDA kernels); torch {torch.__version__} "
                    f"(CUDA build: {torch.version.cuda}) sees no CUDA device")
    return torch.device("cuda", 0)
