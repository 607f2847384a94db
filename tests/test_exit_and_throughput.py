import os
import signal

import pytest

from megatron_zero.training.exit_signal import ExitPolicy
from megatron_zero.metrics.throughput import gpt_flops_per_iteration


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1], ids=["SIGTERM", "SIGUSR1"])
def test_signal_sets_exit_reason(sig):
    """SIGTERM (scancel, the time limit) and SIGUSR1 (#SBATCH --signal=USR1@300) both ask to save and stop."""
    policy = ExitPolicy(handle_signals=True)
    try:
        assert policy.should_exit(1) is None
        os.kill(os.getpid(), sig)
        assert policy.should_exit(2) == "exit signal received"
    finally:
        policy.restore()


def test_interval_and_duration():
    assert ExitPolicy(exit_interval=5).should_exit(5) == "--exit-interval 5 reached"
    assert ExitPolicy(exit_interval=5).should_exit(4) is None
    assert "exit-duration" in ExitPolicy(duration_mins=0.0).should_exit(1)


def test_exit_votes_are_what_every_rank_decides_on():
    """The votes ride in the optimizer step's all-reduce; the sums decide, so a rank that saw no signal
    stops with the one that did. Nothing to vote on without a handler or a time limit."""
    assert ExitPolicy().votes() == () and ExitPolicy(exit_interval=5).votes() == ()
    policy = ExitPolicy(duration_mins=1000.0)
    assert policy.votes() == (0.0, 0.0) and policy.should_exit(7, [0.0, 0.0]) is None
    assert policy.should_exit(7, [1.0, 0.0]) == "exit signal received"  # another rank's signal
    assert "exit-duration" in policy.should_exit(7, [0.0, 2.0])
    assert ExitPolicy(duration_mins=0.0).votes() == (0.0, 1.0)


def test_flops_match_megatron_formula():
    # Megatron-LM: 72 * B * s * L * h^2 * (1 + s/(12h) + V/(12 h L)) with ffn = 4h, the attention's score and
    # context matmuls over the causal half (the paper's s/(6h) counts the whole s x s: causal=False)
    B, s, L, h, V = 8, 1024, 24, 1024, 50304
    for causal, core in ((True, s / (12 * h)), (False, s / (6 * h))):
        megatron = 72 * B * s * L * h * h * (1 + core + V / (12 * h * L))
        assert abs(gpt_flops_per_iteration(B, s, L, h, V, causal=causal) - megatron) / megatron < 1e-12


def test_ctrl_c_votes_once_then_interrupts(capfd):
    """The first Ctrl-C is a vote to stop (named as Ctrl-C), said at once by the rank given a line to say; the
    second raises KeyboardInterrupt (pretrain() turns it into one line and exit code 130)."""
    policy = ExitPolicy(ctrl_c=True, announce="stopping")
    try:
        assert policy.votes() == (0.0, 0.0)
        os.kill(os.getpid(), signal.SIGINT)
        assert policy.votes() == (1.0, 0.0) and policy.should_exit(3, [2.0, 0.0]) == "Ctrl-C received"
        assert capfd.readouterr().out == "stopping\n"
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
    finally:
        policy.restore()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
