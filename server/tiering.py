"""Tiering policy: when a disk hit goes back to memory, which disk records stay hot.

Design. Policy is kept apart from mechanism: ``disk`` (the segment log) moves records and
``tiered_store`` moves objects between tiers; the decisions live here so a
smarter policy (prefix-chain aware, S3-FIFO ghost lists) replaces a class, not
the movers. Both are injected into ``TieredStore`` (``promote=``,
``compaction=``). Demotion order is the memory tier's eviction order (its
``eviction.EvictionPolicy``); this module decides the other questions:

* ``PromotePolicy.on_hit`` — called on each object-level disk hit (a read at
  offset 0, so the slices of one sliced get count once), from connection
  threads, many at once; it must not block. ``never`` keeps disk hits on disk
  (the bench's disk mode), ``first`` promotes every hit, ``second-hit``
  promotes a key hit twice within ``promote_window_ms`` (one-hit wonders stay
  on disk, like a doorkeeper filter). The second-hit table is bounded: the
  oldest entries are forgotten first, which only delays a promotion.
* ``CompactionPolicy`` — which sealed segment compaction reclaims
  (``victim``: called by the mover thread with the segment log's lock held; it
  must not block) and which of its live records are carried to the head of the
  log instead of dropped (``carry``: mover thread, no lock held; must not
  block). ``SecondChance`` (the default) reclaims the segment with the fewest
  live bytes (ties: the oldest) and carries a record whose ``ref`` bit says it
  was read or touched since it was written (``carry_over``); cold records are
  dropped with their segment. The bit is cleared when the record is carried,
  so every record gets one more round and compaction always makes progress.
  ``PolicyOrder`` (the server's, with the disk's ``eviction.EvictionPolicy``: the one
  ``--eviction-policy`` names) drops the records that policy gives up first, one
  segment's worth (``SealedSegment.cold_bytes``), from the segment that leaves the
  fewest other live bytes to carry, and carries the rest.
"""

from __future__ import annotations

import abc
import threading
import time
from collections import OrderedDict
from typing import TYPE_CHECKING, Callable, NamedTuple, Sequence

from gcache.config import PROMOTE_POLICIES

if TYPE_CHECKING:  # the segment log imports this module: no import back at run time
    from gcache.server.disk.records import Entry

__all__ = ["PromotePolicy", "NeverPromote", "PromoteOnFirstHit", "PromoteOnSecondHit",
           "make_promote_policy", "carry_over", "SealedSegment", "CompactionPolicy",
           "SecondChance", "PolicyOrder"]


class PromotePolicy(abc.ABC):
    name = ""

    @abc.abstractmethod
    def on_hit(self, ns: bytes, key: bytes) -> bool:
        """A disk hit on (ns, key): True if it should be copied back to memory now."""


class NeverPromote(PromotePolicy):
    name = "never"

    def on_hit(self, ns: bytes, key: bytes) -> bool:
        return False


class PromoteOnFirstHit(PromotePolicy):
    name = "first"

    def on_hit(self, ns: bytes, key: bytes) -> bool:
        return True


class PromoteOnSecondHit(PromotePolicy):
    name = "second-hit"

    def __init__(self, window_ms: int, clock: Callable[[], float] = time.monotonic,
                 max_tracked: int = 1 << 16) -> None:
        self.window = window_ms / 1000.0
        self.clock = clock
        self.max_tracked = max_tracked
        self._first: OrderedDict[tuple[bytes, bytes], float] = OrderedDict()
        self._lock = threading.Lock()

    def on_hit(self, ns: bytes, key: bytes) -> bool:
        now = self.clock()
        k = (ns, key)
        with self._lock:
            t = self._first.pop(k, None)
            if t is not None and now - t <= self.window:
                return True
            self._first[k] = now
            while len(self._first) > self.max_tracked:
                self._first.popitem(last=False)
            return False


def make_promote_policy(name: str, window_ms: int,
                        clock: Callable[[], float] = time.monotonic) -> PromotePolicy:
    if name == "never":
        return NeverPromote()
    if name == "first":
        return PromoteOnFirstHit()
    if name == "second-hit":
        return PromoteOnSecondHit(window_ms, clock)
    raise ValueError(f"unknown promote_policy {name!r}; use one of {', '.join(PROMOTE_POLICIES)}")


def carry_over(ns: bytes, key: bytes, e: Entry) -> bool:
    """Compaction: keep a record that was read or touched since it was written."""
    return e.ref


class SealedSegment(NamedTuple):
    """What a compaction policy sees of a segment it may reclaim."""

    id: int  # ascending: a higher id was opened later
    live_bytes: int  # record bytes still indexed in it
    created_ns: int
    cold_bytes: int = 0  # of its live bytes, the eviction policy's first to give up
    #                      (``CompactionPolicy.wants_order`` only)


class CompactionPolicy(abc.ABC):
    """Which segment compaction reclaims, and which of its live records it keeps."""

    name = ""
    wants_order = False  # True: the log marks the eviction policy's first candidates

    @abc.abstractmethod
    def victim(self, sealed: Sequence[SealedSegment]) -> int:
        """The id of the segment to reclaim (``sealed`` is never empty). Mover thread,
        segment log lock held: must not block."""

    @abc.abstractmethod
    def carry(self, ns: bytes, key: bytes, e: Entry) -> bool:
        """True: rewrite this live record of the victim at the log's head (its ``ref``
        bit is then cleared); False: drop it with the segment. Mover thread, no lock."""


class SecondChance(CompactionPolicy):
    """Reclaim the emptiest segment (ties: the oldest); carry what was used since."""

    name = "second-chance"

    def victim(self, sealed: Sequence[SealedSegment]) -> int:
        return min(sealed, key=lambda s: (s.live_bytes, s.id)).id

    def carry(self, ns: bytes, key: bytes, e: Entry) -> bool:
        return carry_over(ns, key, e)


class PolicyOrder(CompactionPolicy):
    """Compaction in the disk tier's eviction-policy order (``SegmentLog(eviction_policy=)``).

    The log marks the policy's first candidates in sealed segments, one segment's bytes
    (``cold_bytes``); the victim is the segment that leaves the fewest unmarked live
    bytes to carry (ties: the most marked, then the oldest), so a reclaimed segment
    frees at least its marked bytes. Its marked records are dropped, every other live
    one is carried (the policy said someone else goes first). A log without a policy
    compacts with ``SecondChance`` instead.
    """

    name = "policy-order"
    wants_order = True

    def victim(self, sealed: Sequence[SealedSegment]) -> int:
        return min(sealed, key=lambda s: (s.live_bytes - s.cold_bytes, -s.cold_bytes,
                                          s.id)).id

    def carry(self, ns: bytes, key: bytes, e: Entry) -> bool:
        return True
