"""MoE with context parallelism through pretrain_gpt.py, as users run it: a Llama with MoE layers (4 experts
top-2, switch aux loss and z-loss) at CP2 on 2 ranks for 6 iterations, saving at 3, resumed reshaped while
loading at CP1 (DP2): iterations 4-6 log the uninterrupted run's language-model loss within relative 1e-5
(tests/test_cli_resume.py's bound: 7 printed digits, fp32 sums reordered by another layout), and the MoE
losses of the log interval (the CP ranks' shares summed) the uninterrupted run's within 1e-5 too. The CP2
run's aux losses enter its gradients scaled by CP, as its language-model loss does; without that factor the
resumed losses drift from the uninterrupted run's past the bound.

With expert parallelism: EP2 x CP2 on 4 ranks (DP 1, the EP group the CP group, the experts' files by
expert-DP rank in DeepSpeed-MoE's layout), 6 iterations saving at 3, resumed as saved (bit-identical) and
reshaped while loading at EP1 x CP1 (DP 4; within the same 1e-5), and converted by tools/ds_to_universal.py
and loaded at EP4 x CP1 (DP 4, within 1e-5)."""
import re

import pytest

from megatron_zero.testing.cli import CliResume, cli_flags, logged_losses, text_data

pytestmark = [pytest.mark.multirank, pytest.mark.slow]

MOE = {"num-experts": 4, "moe-router-topk": 2, "moe-aux-loss-coeff": 1e-2, "moe-z-loss-coeff": 1e-3,
       "moe-layer-freq": 2}
REL = 1e-5


def moe_losses(stdout: str):
    return [(float(a), float(b)) for a, b in
            re.findall(r"load_balancing_loss: ([0-9.E+-]+) \| z_loss: ([0-9.E+-]+)", stdout)]


def test_moe_cp2_resumes_at_cp1(tmp_path):
    data = text_data(str(tmp_path / "text"))
    run = CliResume(str(tmp_path), lambda *changes: cli_flags(data, str(tmp_path / "cache"), "llama", MOE, *changes),
                    {"context-parallel-size": 2, "zero-stage": 1}, nproc=2)
    resumed_run = run.resume_run("reshaped", {"context-parallel-size": 1})
    run.assert_matches(logged_losses(resumed_run), REL)
    saved, resumed = moe_losses(run.stdout), moe_losses(resumed_run.stdout)
    assert len(saved) == 6 and len(resumed) == 3, (saved, resumed)
    for want, got in zip(saved[3:], resumed):
        for w, g in zip(want, got):
            assert abs(g - w) <= REL * abs(w), (saved, resumed)


def test_moe_ep2_cp2_resumes_as_saved_and_at_ep1_cp1(tmp_path):
    data = text_data(str(tmp_path / "text"))
    run = CliResume(str(tmp_path), lambda *changes: cli_flags(data, str(tmp_path / "cache"), "llama", MOE, *changes),
                    {"context-parallel-size": 2, "expert-model-parallel-size": 2, "zero-stage": 1}, nproc=4)
    run.assert_matches(run.resume("as saved"), 0.0)
    resumed_run = run.resume_run("reshaped", {"context-parallel-size": 1, "expert-model-parallel-size": 1})
    run.assert_matches(logged_losses(resumed_run), REL)
    saved, resumed = moe_losses(run.stdout), moe_losses(resumed_run.stdout)
    assert len(saved) == 6 and len(resumed) == 3, (saved, resumed)
    for want, got in zip(saved[3:], resumed):
        for w, g in zip(want, got):
            assert abs(g - w) <= REL * abs(w), (saved, resumed)
    universal = run.resume("universal", {"context-parallel-size": 1, "expert-model-parallel-size": 4})
    run.assert_matches(universal, REL)  # tools/ds_to_universal.py, loaded at EP4 x DP4
