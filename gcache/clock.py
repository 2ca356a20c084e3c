"""The clock, injected wherever time decides behaviour (deadlines, heartbeats, leases,
failure detection), so tests can run those loops on virtual time.

``Clock`` is the contract: ``monotonic()`` in seconds, and ``wait(event, timeout)``, which
blocks until the event is set or the timeout passes on *this* clock. Production code
uses ``SYSTEM``; tests use ``VirtualClock`` and move time with ``advance``.

Threads: both methods may be called from any thread. ``wait`` blocks the caller (that is
its purpose); ``monotonic`` never blocks.
"""

from __future__ import annotations

import threading
import time
from typing import Protocol

__all__ = ["Clock", "SystemClock", "VirtualClock", "SYSTEM"]


class Clock(Protocol):
    def monotonic(self) -> float:
        """Seconds on a clock that never goes back."""
        ...

    def wait(self, event: threading.Event, timeout: float | None) -> bool:
        """Block until ``event`` is set (True) or ``timeout`` seconds pass on this
        clock (False). ``None`` waits for the event only."""
        ...


class SystemClock:
    """The real clock: ``time.monotonic`` and ``Event.wait``."""

    __slots__ = ()

    @staticmethod
    def monotonic() -> float:
        return time.monotonic()

    @staticmethod
    def wait(event: threading.Event, timeout: float | None) -> bool:
        return event.wait(timeout)


SYSTEM = SystemClock()


class VirtualClock:
    """A clock that moves only when a test calls ``advance``. A thread in ``wait`` wakes
    when its event is set or when ``advance`` carries time past its timeout."""

    def __init__(self, start: float = 1000.0) -> None:
        self._now = start
        self._cond = threading.Condition()

    def monotonic(self) -> float:
        with self._cond:
            return self._now

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError("a monotonic clock never goes back")
        with self._cond:
            self._now += seconds
            self._cond.notify_all()

    def wait(self, event: threading.Event, timeout: float | None) -> bool:
        with self._cond:
            end = None if timeout is None else self._now + timeout
            while not event.is_set():
                if end is not None and self._now >= end:
                    return False
                # Events are set from other threads without this condition: poll them on a
                # short real-time tick, and wake at once on ``advance``.
                self._cond.wait(0.005)
            return True
