"""The toy model of megatron_zero.testing.toy_zero learns under the single-process AdamW reference, so the
ZeRO parity tests that compare against it compare a trajectory that moves."""
from megatron_zero.testing.toy_zero import reference


def test_reference_learns():
    losses, _ = reference(steps=20)
    assert losses[-1] < losses[0] - 0.1, losses
