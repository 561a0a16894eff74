"""The warmup-stable-decay learning-rate schedule."""

import pytest

from training.core.schedules import wsd_lr


def lrs(total=100, warmup=10, decay_frac=0.2, floor=0.1):
    return [wsd_lr(s, total, 1.0, warmup, decay_frac, floor) for s in range(total)]


def test_warmup_rises_linearly_to_the_base_lr():
    x = lrs()
    assert x[:10] == pytest.approx([(i + 1) / 10 for i in range(10)])


def test_stable_phase_holds_the_base_lr():
    assert set(lrs()[10:80]) == {1.0}


def test_decay_falls_monotonically_to_the_floor_on_the_last_step():
    tail = lrs()[80:]
    assert all(a > b for a, b in zip(tail, tail[1:]))
    assert tail[-1] == pytest.approx(0.1)


def test_no_decay_and_no_warmup_is_constant():
    assert set(lrs(warmup=0, decay_frac=0.0)) == {1.0}


def test_warmup_longer_than_the_run_is_clipped():
    x = lrs(total=5, warmup=50, decay_frac=0.5)
    assert x == pytest.approx([0.2, 0.4, 0.6, 0.8, 1.0])
