"""Context parallelism through the command line, as users drive it: pretrain_gpt.py trains a Llama (RoPE,
2 KV groups) at CP2 x TP2 with sequence parallelism on 4 ranks for 6 iterations, saving at 3; runs resumed
from that checkpoint log the uninterrupted run's losses at iterations 4-6:

- as saved (CP2 x TP2): bit-identical, the same ranks running the same operations on the restored state;
- reshaped while loading at CP1 (TP2 x DP2), and at CP4 (TP1): relative 1e-5. Parameters are not sharded
  by CP, so a CP change is a change of the ZeRO partition count (DP x CP) and, at CP4, of TP; the losses
  at 4-6 are computed on the whole sequence (CP1) or in four chunks (CP4), so they also check the data
  loader's chunking against the CP2 run's. The bound is tests/test_cli_resume.py's: the log prints 7
  digits, another layout reorders fp32 sums by a few eps per step;
- converted by tools/ds_to_universal.py and loaded with --universal-checkpoint at CP1: relative 1e-5.

The default tier resumes as saved and reshaped at CP1; CP4 and the universal resume are `slow`.
"""
import pytest

from megatron_zero.testing.cli import CliResume, cli_flags, text_data

pytestmark = pytest.mark.multirank

AS_SAVED_REL, RESHAPED_REL = 0.0, 1e-5
SAVED = {"tensor-model-parallel-size": 2, "context-parallel-size": 2, "sequence-parallel": True, "zero-stage": 1}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("cp_cli")
    data = text_data(str(root / "text"))
    return CliResume(str(root), lambda *changes: cli_flags(data, str(root / "cache"), "llama", *changes), SAVED,
                     nproc=4)


def test_resume_as_saved(run):
    run.assert_matches(run.resume("as saved"), AS_SAVED_REL)


@pytest.mark.parametrize("layout", [{"context-parallel-size": 1}, pytest.param(
    {"context-parallel-size": 4, "tensor-model-parallel-size": 1, "sequence-parallel": False},
    marks=pytest.mark.slow)], ids=["cp1", "cp4"])
def test_resume_reshaped(run, layout):
    run.assert_matches(run.resume("reshaped", layout), RESHAPED_REL)


@pytest.mark.slow
def test_resume_universal_at_cp1(run):
    run.assert_matches(run.resume("universal", {"context-parallel-size": 1}), RESHAPED_REL)


@pytest.mark.slow
def test_attention_dropout_with_p2p_resumes_as_saved(tmp_path):
    """--attention-dropout 0.1 at CP2 (p2p): trains, and resumed as saved it draws the same masks (the RNG
    tracker's states are in the checkpoint), so the losses are bit-identical. Default-tier cover:
    tests/test_context_parallel_attention.py (the masks against the whole-sequence reference, replay)."""
    data = text_data(str(tmp_path / "text"))
    run = CliResume(str(tmp_path), lambda *changes: cli_flags(data, str(tmp_path / "cache"), "llama", *changes,
                                                              {"attention-dropout": 0.1}),
                    {"context-parallel-size": 2, "zero-stage": 1}, nproc=2)
    run.assert_matches(run.resume("as saved"), AS_SAVED_REL)


@pytest.mark.slow
def test_hierarchical_a2a_p2p_resumes_at_cp1(tmp_path):
    """--cp-comm-type a2a+p2p --hierarchical-context-parallel-sizes 2 2 at CP4 (all-to-all groups of 2, rings
    of 2) trains, and its checkpoint resumed at CP1 (DP4) logs its losses within RESHAPED_REL. Default-tier
    cover: tests/test_context_parallel_parity.py (a2a+p2p against the reference)."""
    data = text_data(str(tmp_path / "text"))
    run = CliResume(str(tmp_path), lambda *changes: cli_flags(data, str(tmp_path / "cache"), "llama", *changes),
                    {"context-parallel-size": 4, "cp-comm-type": "a2a+p2p",
                     "hierarchical-context-parallel-sizes": [2, 2], "zero-stage": 1}, nproc=4)
    run.assert_matches(run.resume("reshaped", {"context-parallel-size": 1, "cp-comm-type": "p2p",
                                               "hierarchical-context-parallel-sizes": None}), RESHAPED_REL)
