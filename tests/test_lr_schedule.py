import math

import pytest

from megatron_zero.optimizer.lr_schedule import LRSchedule


def test_warmup_then_cosine_to_min():
    s = LRSchedule(1.0, 0.1, warmup_steps=10, decay_steps=110, decay_style="cosine")
    assert s.lr(0) == 0.0 and s.lr(5) == pytest.approx(0.5) and s.lr(10) == pytest.approx(1.0)
    assert s.lr(60) == pytest.approx(0.1 + 0.5 * 0.9)
    assert s.lr(110) == pytest.approx(0.1) and s.lr(500) == pytest.approx(0.1)


def test_linear_and_constant():
    lin = LRSchedule(2.0, 0.0, warmup_steps=0, decay_steps=100, decay_style="linear")
    assert lin.lr(25) == pytest.approx(1.5)
    const = LRSchedule(2.0, 0.0, warmup_steps=4, decay_steps=100, decay_style="constant")
    assert const.lr(2) == pytest.approx(1.0) and const.lr(50) == 2.0


def test_state_round_trip_continues_the_curve():
    a = LRSchedule(1.0, 0.0, warmup_steps=3, decay_steps=20, decay_style="cosine")
    for _ in range(7):
        a.step()
    b = LRSchedule(1.0, 0.0, warmup_steps=3, decay_steps=20, decay_style="cosine")
    b.load_state_dict(a.state_dict())
    assert [a.step() for _ in range(5)] == [b.step() for _ in range(5)]
    assert not math.isnan(a.lr())
