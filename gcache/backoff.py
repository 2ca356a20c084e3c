"""Jittered exponential backoff for retry loops (masters unreachable, a long-poll that
failed): the n-th pause is ``min(cap, base * 2**n)`` scaled by a random factor in
[0.5, 1) ("equal jitter"), so a fleet of clients that lost the masters together does not
retry in lockstep, and one that keeps failing slows down to ``cap``. ``reset()`` after a
success. Not thread-safe: one per loop."""

from __future__ import annotations

import random
from collections.abc import Callable


class Backoff:
    def __init__(self, base_s: float, cap_s: float,
                 rng: Callable[[], float] = random.random) -> None:
        if not 0 < base_s <= cap_s:
            raise ValueError(f"backoff needs 0 < base ({base_s}) <= cap ({cap_s})")
        self.base, self.cap, self._rng = base_s, cap_s, rng
        self._n = 0

    def next(self) -> float:
        """The next pause in seconds (and count the failure)."""
        step = min(self.cap, self.base * (1 << min(self._n, 30)))
        self._n += 1
        return step * (0.5 + self._rng() / 2)

    def reset(self) -> None:
        self._n = 0
