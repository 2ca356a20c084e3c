"""The handoff's rate cap (``--migrate-mbps``): the token bucket holds the rate over time
from an empty bucket (a batch larger than the burst waits for all its bytes; idle time
saves up at most the burst), refuses a wait past its deadline without spending, ends a
wait when stopped, and never waits without a cap. On a clock that moves only when waited
on, so the numbers are exact."""

from __future__ import annotations

import threading

import pytest

from gcache.server.handoff import TokenBucket

pytestmark = [pytest.mark.unit, pytest.mark.timeout(10)]


class SteppingClock:
    """A ``gcache.clock.Clock`` whose time moves only by what its callers wait."""

    def __init__(self) -> None:
        self.now = 100.0

    def monotonic(self) -> float:
        return self.now

    def wait(self, event: threading.Event, timeout: float | None) -> bool:
        if event.is_set():
            return True
        self.now += timeout or 0.0
        return event.is_set()


def capped(rate: float = 1e6, burst: int = 100_000):
    """A bucket of ``rate`` bytes/s on a fresh ``SteppingClock``: (clock, stop, bucket)."""
    clock = SteppingClock()
    return clock, threading.Event(), TokenBucket(rate, burst, clock)


def test_rate_holds_over_many_batches():
    clock, stop, bucket = capped()
    t0 = clock.now
    for _ in range(100):
        assert bucket.take(100_000, stop, clock.now + 60)
    # 10 MB at 1 MB/s, from an empty bucket
    assert 9.95 <= clock.now - t0 <= 10.05


def test_batch_larger_than_burst_waits_for_all_its_bytes():
    clock, stop, bucket = capped()
    t0 = clock.now
    assert bucket.take(2_000_000, stop, clock.now + 60)
    assert bucket.take(2_000_000, stop, clock.now + 60)
    assert 3.95 <= clock.now - t0 <= 4.05


def test_saved_up_bytes_are_capped_at_the_burst():
    clock, stop, bucket = capped()
    clock.now += 100  # idle: saves up 100 KB, not 100 MB
    t0 = clock.now
    assert bucket.take(100_000, stop, clock.now + 60)
    assert clock.now == t0
    assert bucket.take(1_000_000, stop, clock.now + 60)
    assert 0.95 <= clock.now - t0 <= 1.05


def test_wait_past_deadline_is_refused_without_spending():
    clock, stop, bucket = capped()
    t0 = clock.now
    assert not bucket.take(1_000_000, stop, clock.now + 0.5)  # needs 1 s
    assert clock.now == t0  # no wait, nothing spent
    assert bucket.take(1_000_000, stop, clock.now + 5)
    assert 0.95 <= clock.now - t0 <= 1.05


def test_stop_ends_the_wait():
    clock, stop, bucket = capped()
    stop.set()
    assert not bucket.take(5_000_000, stop, clock.now + 60)


def test_no_cap_never_waits():
    clock, stop, bucket = capped(rate=0)
    for _ in range(1000):
        assert bucket.take(10_000_000, stop, clock.now)
    assert clock.now == 100.0
