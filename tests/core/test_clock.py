"""The injected clock: a VirtualClock moves only on ``advance`` and wakes waiters then."""

from __future__ import annotations

import threading

import pytest

from gcache.clock import SYSTEM, VirtualClock

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]


def test_virtual_wait_times_out_only_when_time_is_advanced_past_it():
    clock, event, got = VirtualClock(), threading.Event(), []
    t = threading.Thread(target=lambda: got.append(clock.wait(event, 5.0)))
    t.start()
    clock.advance(4.9)
    t.join(0.1)
    assert t.is_alive() and got == []
    clock.advance(0.2)
    t.join(5)
    assert got == [False]


def test_virtual_wait_returns_true_when_the_event_is_set():
    clock, event, got = VirtualClock(), threading.Event(), []
    t = threading.Thread(target=lambda: got.append(clock.wait(event, 5.0)))
    t.start()
    event.set()
    t.join(5)
    assert got == [True] and clock.monotonic() == 1000.0


def test_virtual_clock_never_goes_back_and_system_wait_times_out():
    with pytest.raises(ValueError):
        VirtualClock().advance(-1)
    assert SYSTEM.wait(threading.Event(), 0.01) is False
    assert SYSTEM.monotonic() <= SYSTEM.monotonic()
