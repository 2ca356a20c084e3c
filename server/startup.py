"""Where a gcache-server is in its life, for the log, ``/readyz`` and a gauge.

A server binds its ports first, then opens (or creates) and prefaults its arena, then
scans a reused arena (recovery), then starts its threads and serves; a SIGTERM stops it.
``Startup`` holds the current ``Phase`` and, for the long phases (prefault, recovery), how
far it got, and logs that progress at most once a second with its rate, so an operator
watching a 64 GiB arena prefault sees it move.

Threads: ``enter`` runs on the owner's thread (``Server.__init__``, ``start``, ``stop``);
a ``progress`` callback may run on any thread (the prefault runs one per core; calls are
serialised by the caller or by the lock here); ``snapshot`` and ``describe`` on any thread
(scrapes, probes). Nothing here blocks.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Callable

from gcache.config import format_size

log = logging.getLogger("gcache.server")


class Phase(str, enum.Enum):
    """A server's phase, in the order it goes through them (wire- and metric-stable)."""

    BINDING = "binding"
    PREFAULT = "prefault"
    RECOVERY = "recovery"
    STARTING = "starting"
    SERVING = "serving"
    STOPPING = "stopping"


# what /readyz says while the server is in a phase before serving
_DOING = {Phase.BINDING: "binding its ports", Phase.PREFAULT: "prefaulting the arena",
          Phase.RECOVERY: "recovering the arena's objects",
          Phase.STARTING: "starting its threads", Phase.STOPPING: "stopping"}


class Startup:
    """The current phase and its progress; see the module docstring."""

    def __init__(self, clock: Callable[[], float] = time.monotonic,
                 log_every_s: float = 1.0) -> None:
        self._clock = clock
        self._every = log_every_s
        self._lock = threading.Lock()
        self._phase = Phase.BINDING
        self._done = self._total = 0
        self._since = clock()
        self._logged = self._since

    def enter(self, phase: Phase) -> None:
        """Move to ``phase`` (its progress starts at 0)."""
        with self._lock:
            self._phase, self._done, self._total = phase, 0, 0
            self._since = self._logged = self._clock()
        log.info("start-up phase: %s", phase.value)

    def progress(self, unit: str) -> Callable[[int, int], None]:
        """A ``progress(done, total)`` callback for the current phase, counting ``unit``
        ("bytes" or "objects"); it logs percent and rate at most once per interval, and
        once when done reaches total."""

        def report(done: int, total: int) -> None:
            with self._lock:
                self._done, self._total = done, total
                now = self._clock()
                if done < total and now - self._logged < self._every:
                    return
                self._logged = now
                phase, took = self._phase, max(now - self._since, 1e-9)
            pct = 100.0 * done / total if total else 100.0
            if unit == "bytes":
                what = (f"{format_size(done, approx=True)} of "
                        f"{format_size(total, approx=True)}, {done / took / 1e9:.2f} GB/s")
            else:
                what = f"{done:,} of {total:,} {unit}, {done / took:,.0f} {unit}/s"
            log.info("%s %.0f%% (%s)", phase.value, pct, what,
                     extra={"fields": {"phase": phase.value, "done": done, "total": total,
                                       "seconds": round(took, 3)}})

        return report

    def snapshot(self) -> tuple[Phase, float]:
        """``(phase, fraction done of its progress, 0..1; 0 when it reports none)``."""
        with self._lock:
            return self._phase, (self._done / self._total if self._total else 0.0)

    def describe(self) -> str:
        """What the server is doing, for /readyz: "prefaulting the arena (37%)"."""
        phase, frac = self.snapshot()
        if phase is Phase.SERVING:
            return "serving"
        doing = _DOING[phase]
        return f"{doing} ({frac:.0%})" if frac else doing
