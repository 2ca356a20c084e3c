"""``Backoff``: pauses double up to the cap, each scaled into [0.5, 1) by the jitter, and
start over after ``reset``."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gcache.backoff import Backoff

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]


def test_pauses_double_to_the_cap_and_reset_starts_over() -> None:
    b = Backoff(0.1, 1.0, rng=lambda: 1.0)  # the jitter's top: exactly the step
    assert [round(b.next(), 6) for _ in range(6)] == [0.1, 0.2, 0.4, 0.8, 1.0, 1.0]
    b.reset()
    assert b.next() == pytest.approx(0.1)
    low = Backoff(0.1, 1.0, rng=lambda: 0.0)
    assert low.next() == pytest.approx(0.05)  # the jitter's bottom: half the step


@given(st.lists(st.floats(min_value=0, max_value=0.999999), min_size=1, max_size=50))
def test_every_pause_is_within_half_and_all_of_its_step(draws: list[float]) -> None:
    it = iter(draws)
    b = Backoff(0.05, 2.0, rng=lambda: next(it))
    for n in range(len(draws)):
        step = min(2.0, 0.05 * 2 ** n)
        assert step / 2 <= b.next() < step


def test_bad_bounds_are_refused() -> None:
    with pytest.raises(ValueError):
        Backoff(0, 1)
    with pytest.raises(ValueError):
        Backoff(2, 1)
