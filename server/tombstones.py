"""Tombstones: a handoff put never brings back a key deleted at its owner.

A handoff put (``"ia": 1``, publish only if absent) carries a copy the handoff worker
read from the key's previous owner some time before. A client deleting the key meanwhile
deletes it at both owners (the SDK's window), but the put may arrive *after* that delete
and find the key absent: it would resurrect a deleted key. So every server remembers the
(namespace, key) pairs deleted on it recently, with the time, for ``ttl_s`` (long enough
to cover a handoff put's life: its deadline, twice, plus the server's request deadline),
and an if-absent put of a key deleted within ``ttl_s`` is skipped: it answers OK, like
any skipped if-absent put, and is counted (``put_if_absent_tombstoned``).

Bounded: at most ``max_entries`` tombstones, the oldest dropped first. A tombstone
dropped before its time would reopen the door, so its time is kept as a *floor*: until
that time plus ``ttl_s``, every if-absent put is skipped (a delete storm costs handoff
copies, a miss later, never a resurrected key).

A regular put does not clear a tombstone: an if-absent copy arriving after it is older
than that put anyway (it was read before the delete), so skipping it is right even if
the put's value is gone again by then.

Cost: O(1) per delete (an ordered dict insert at the end; expired entries are trimmed
from the front on the way) and per if-absent put item (a dict lookup); nothing for
other puts or reads.

Threads: every method runs on connection threads and takes one short lock.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any

from gcache.clock import SYSTEM, Clock

MAX_ENTRIES = 65536


class Tombstones:
    def __init__(self, ttl_s: float, max_entries: int = MAX_ENTRIES,
                 clock: Clock = SYSTEM) -> None:
        self.ttl_s, self.max_entries, self.clock = ttl_s, max(1, max_entries), clock
        self._at: OrderedDict[tuple[bytes, bytes], float] = OrderedDict()  # oldest first
        self._floor = -float("inf")  # time of the newest tombstone dropped by the cap
        self._lock = threading.Lock()
        self._skipped = 0

    def deleted(self, ns: bytes, key: bytes) -> None:
        """A client deleted ``key`` here (whether or not it was held): remember it."""
        now = self.clock.monotonic()
        with self._lock:
            at = self._at
            at[(ns, key)] = now
            at.move_to_end((ns, key))
            horizon = now - self.ttl_s
            while at:  # trim what expired, then what the cap does not fit
                k, t = next(iter(at.items()))
                if t > horizon and len(at) <= self.max_entries:
                    break
                del at[k]
                if t > horizon:
                    self._floor = max(self._floor, t)

    def blocks(self, ns: bytes, key: bytes, since: float | None = None) -> bool:
        """Must an if-absent put of ``key`` be skipped (deleted within ``ttl_s``, or the
        cap dropped a tombstone that recent)? With ``since`` (a ``now()`` taken
        earlier): only a delete at or after it counts (no floor). Counts a skip."""
        now = self.clock.monotonic()
        with self._lock:
            t = self._at.get((ns, key))
            if since is None:
                hit = (t is not None and now - t < self.ttl_s) or now - self._floor < self.ttl_s
            else:
                hit = t is not None and t >= since
            if hit:
                self._skipped += 1
            return hit

    def guard(self, ns: bytes) -> IfAbsentGuard:
        """The check of one if-absent put frame of namespace ``ns``."""
        return IfAbsentGuard(self, ns, self.clock.monotonic())

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {"put_if_absent_tombstoned": self._skipped, "tombstones": len(self._at)}


class IfAbsentGuard:
    """One if-absent put frame's tombstone checks (PUT and PUT_STAGED, connection
    thread). ``skip(key)`` before an item is reserved: True when it must be skipped.
    ``settle(tier, key)`` after the item was committed (answered OK): a delete that
    landed while the item was in flight (between ``skip`` and the publish, which are not
    one atomic step) left a tombstone newer than the frame, so what stands under the key
    now is deleted again (at worst a regular put that raced both: a miss, never a
    resurrected key)."""

    __slots__ = ("tombs", "ns", "since")

    def __init__(self, tombs: Tombstones, ns: bytes, since: float) -> None:
        self.tombs, self.ns, self.since = tombs, ns, since

    def skip(self, key: bytes) -> bool:
        return self.tombs.blocks(self.ns, key)

    def settle(self, tier: Any, key: bytes) -> None:
        if self.tombs.blocks(self.ns, key, self.since):
            tier.delete(self.ns, key)


__all__ = ["IfAbsentGuard", "MAX_ENTRIES", "Tombstones"]
