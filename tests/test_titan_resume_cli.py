"""The torchtitan (DCP) round trip keeps the data position, driven as a user does: pretrain_gpt.py trains a Llama
6 iterations on 2 ranks saving at 3; tools/convert_checkpoint.py writes that checkpoint as torchtitan's step-3
(--to dcp) and back (--from dcp --to universal); --universal-checkpoint resumes it, and iterations 4-6 log the
uninterrupted run's losses within 1e-5 relative (tests/test_cli_resume.py's bound for a universal resume: fp32
sums in another order, printed to 7 digits). Before, the round trip lost the samples consumed: the resumed run
read the data from its start and iteration 4's loss differed by far more (7.412 against 7.606 in one such run).
"""
import os

import pytest

from megatron_zero.testing.cli import (ARCHITECTURES, CliResume, cli_flags, layout_flags, logged_losses, text_data,
                                       tool)

pytestmark = [pytest.mark.slow, pytest.mark.multirank]


def test_dcp_round_trip_resumes_where_the_run_was(tmp_path):
    data = text_data(str(tmp_path / "text"))
    run = CliResume(str(tmp_path / "run"), lambda *changes: cli_flags(data, str(tmp_path / "cache"), "llama",
                                                                       *changes), layout_flags())
    tool("convert_checkpoint.py", "--from", "deepspeed", "--to", "dcp", "--input", run.checkpoint, "--output",
         tmp_path / "titan", "--quiet")
    llama = ARCHITECTURES["llama"]
    back = tool("convert_checkpoint.py", "--from", "dcp", "--to", "universal", "--input", tmp_path / "titan" / "step-3",
                "--output", tmp_path / "u" / "step3", "--num-attention-heads", 4, "--seq-length", 16, "--norm-epsilon",
                llama["norm-epsilon"], "--quiet")
    assert "data position: 24 samples consumed, as the checkpoint records them" in back.stdout, back.stdout
    run._universal = os.path.join(tmp_path, "u", "step3")
    resumed = run.resume_run("universal")
    assert "from iteration 3 (24 samples consumed)" in resumed.stdout, resumed.stdout[-2000:]
    run.assert_matches(logged_losses(resumed), 1e-5)
