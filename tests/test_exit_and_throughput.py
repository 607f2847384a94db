import os
import signal

import pytest

from megatron_zero.exit_signal import ExitPolicy
from megatron_zero.throughput import gpt_flops_per_iteration


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


def test_flops_match_megatron_formula():
    # Megatron: 72 * B * s * L * h^2 * (1 + s/(6h) + V/(12 h L)) with ffn = 4h.
    B, s, L, h, V = 8, 1024, 24, 1024, 50304
    megatron = 72 * B * s * L * h * h * (1 + s / (6 * h) + V / (12 * h * L))
    assert abs(gpt_flops_per_iteration(B, s, L, h, V) - megatron) / megatron < 1e-12
