"""KV events, the tiers' contract: what a tier reports at each index change, for the
publisher (``kv_event_publisher``). The wire records and topics are the core's
(``gcache.kv_events``); the design: ``docs/kv-events.md``.

* ``EventQueue``: one per tier. The tier calls ``stored(ns, key, parent)`` when an object
  becomes current in its index (a put, a replace, a promotion into memory, a demotion
  onto disk, a compaction carry) and ``removed(ns, key)`` when it leaves it (eviction,
  demotion out of memory, delete, a newer version elsewhere, a corrupt drop, a disk
  record compacted away or killed by a quota); ``parent`` is the key of the page before
  it in its chain when its writer named one (``chain_parent``), for the event's
  ``parent_block_hash``. Threads: the tier's own, with **the
  tier's lock held** (connection threads, the evictor, the mover), which serialises the
  calls of one queue. They never block and make no syscall: a ``deque`` append, or,
  past ``max_events``, a counted drop (``dropped``) that the publisher turns into a
  visible sequence gap. ``drain`` is the publisher thread's.
* ``Resident``: one row of a snapshot (what a tier holds now; the server's
  ``_resident`` walks the tiers' ``held()``).
"""

from __future__ import annotations

from collections import deque
from typing import NamedTuple

from gcache.errors import ConfigError
from gcache.kv_events import Medium

__all__ = ["EventQueue", "Resident"]


class Resident(NamedTuple):
    """One object a tier holds now (a snapshot row)."""

    ns: bytes
    key: bytes
    medium: Medium


# ---------------------------------------------------------------- the tiers' side
class EventQueue:
    """One tier's index changes, for the publisher. ``stored`` / ``removed`` are called
    with that tier's lock held, which serialises them; they never block and make no
    syscall. Bounded: past ``max_events`` an event is dropped and counted (``dropped``),
    and the publisher makes the gap visible."""

    __slots__ = ("medium", "_q", "_cap", "dropped")

    def __init__(self, medium: Medium, max_events: int) -> None:
        if max_events < 1:
            raise ConfigError(f"kv_events_queue_events {max_events} must be at least 1")
        self.medium = medium
        self._q: deque[tuple[bool, bytes, bytes, bytes | None]] = deque()
        self._cap = max_events
        self.dropped = 0

    def stored(self, ns: bytes, key: bytes, parent: bytes | None = None) -> None:
        if len(self._q) < self._cap:
            self._q.append((True, ns, key, parent))
        else:
            self.dropped += 1

    def removed(self, ns: bytes, key: bytes) -> None:
        if len(self._q) < self._cap:
            self._q.append((False, ns, key, None))
        else:
            self.dropped += 1

    def drain(self, limit: int) -> list[tuple[bool, bytes, bytes, bytes | None]]:
        """Up to ``limit`` events, oldest first (the publisher thread only)."""
        out = []
        q = self._q
        try:
            for _ in range(limit):
                out.append(q.popleft())
        except IndexError:
            pass
        return out
