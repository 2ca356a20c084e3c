"""The memory <-> disk movement contract: what the mover may call on each tier, and what
crosses between them.

Design. ``tiered_store.TieredStore`` (the mover) puts the memory tier in front of the
disk tier and moves objects between them. It is written only against the two
protocols here: ``MemorySide`` (implemented by ``memory_tier.MemoryTier``) and
``DiskSide`` (implemented by ``disk.SegmentLog``). Neither side knows the
other's internals; every method takes its side's own lock, so the mover holds no lock
of theirs. Records crossing the seam:

* ``ColdObject`` — frozen: one object memory hands over for demotion
  (``claim_cold``). Its bytes stay pinned and readable (``data_view``) until it goes
  back through ``finish_demotion``; ``handle`` is memory's own and opaque to the rest.
* ``DemoteItem`` — what the mover asks the disk to write (``append``). The disk
  answers, per item, an opaque *written* handle (publish it with ``publish``, or
  give it up with ``discard``) or a ``Status`` (CORRUPT: the bytes failed their
  checksum on the way; NO_SPACE: the disk is full or degraded).
* ``ReadLease`` — the token of a disk-served ``Pinned``: the verified bytes and what
  they are, so the mover can promote them after the reply went out.
* ``MemoryHooks`` — what memory calls on the tier below, with its own lock held, so
  the index change and the disk change are one step: ``on_publish`` (a put
  replaced the key: kill older disk copies), ``on_delete`` (delete the disk copy
  too), ``is_clean`` (an identical disk copy exists: evicting it loses nothing),
  ``exists`` (any disk copy: an if-absent put is skipped), ``on_delete_version``
  (delete the disk copy if it is that version: the handoff's delete-if-version).
  Given once, by ``MemorySide.attach`` (the mover builds them from the disk side:
  ``disk_hooks``), never assigned attribute by attribute.

Lock order (``LockRank``): the memory tier's lock, then the disk's. Memory calls the
disk with its lock held (the hooks, and the ``publish`` / ``still_valid``
callbacks it runs under its lock); the disk never calls memory, and the mover calls
either side holding neither lock. ``ranked_lock`` makes each side's lock: a plain
``threading.Lock``, or, with the ``lock_order`` failpoint on when the lock is made
(tests), one that raises ``WiringError`` on a take against the order.

Threads and blocking, per method: see each protocol's docstrings. "Connection
threads" are the service's IO threads (many at once); "the mover" is the tiered
store's one background thread (also the only writer of the disk); "startup" is the
thread that builds the store, before any other runs.
"""

from __future__ import annotations

import enum
import mmap
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, NamedTuple, Protocol

from gcache.errors import WiringError
from gcache.failpoints import failpoint
from gcache.quotas import QuotaStore
from gcache.server.tier import HeldObject, Pinned, PutSlot
from gcache.status import Status

__all__ = ["ColdObject", "DemoteItem", "ReadLease", "MemoryHooks", "MemorySide", "DiskSide",
           "LockRank", "ranked_lock", "disk_hooks"]


# ---------------------------------------------------------------- records crossing the seam
class ColdObject(NamedTuple):
    """One object claimed for demotion (``MemorySide.claim_cold``)."""

    ns: bytes
    key: bytes
    version: int
    length: int  # value bytes
    checksum: int  # xxh3_64 of the value, as committed
    chunk: int  # memory bytes it frees when dropped
    handle: Any  # memory's own record of it; only memory reads it
    ph: int | None = None  # its placement hash (``Tier`` docstring), kept on disk


class DemoteItem(NamedTuple):
    """One record for ``DiskSide.append``."""

    ns: bytes
    key: bytes
    version: int
    data: memoryview
    checksum: int  # the disk verifies the copied bytes against it
    created_ns: int = 0
    ph: int | None = None  # placement hash, kept in the record (None: none)


@dataclass(slots=True, eq=False)
class ReadLease:
    """Token of a disk-served ``Pinned``: the verified buffer and what it holds."""

    mm: mmap.mmap | None  # the disk's buffer; given back by ``DiskSide.release``
    ns: bytes
    key: bytes
    version: int
    length: int
    checksum: int
    whole: memoryview | None = None  # the whole verified object, when the read covered it
    first: bool = False  # the read started at offset 0 (one object-level hit)
    ph: int | None = None  # the record's placement hash (promotion keeps it)
    # a read into a caller's destination (``read_many(dest=)``) instead of ``mm``: (the
    # destination's token, where the view starts in it); the caller gives it back
    scratch: tuple[Any, int] | None = None


class MemoryHooks(NamedTuple):
    """What memory calls on the tier below, its lock held (must not block on IO)."""

    on_publish: Callable[[bytes, bytes, int], object]  # (ns, key, version) now current
    on_delete: Callable[[bytes, bytes], bool]  # (ns, key) deleted; True if below had it
    is_clean: Callable[[bytes, bytes, int], bool]  # an identical copy exists below
    exists: Callable[[bytes, bytes], bool]  # any copy exists below (if-absent puts)
    on_delete_version: Callable[[bytes, bytes, int], bool]  # delete below if that version


def disk_hooks(disk: DiskSide) -> MemoryHooks:
    """The hooks that keep one authoritative copy per key across memory and ``disk``."""
    return MemoryHooks(on_publish=disk.invalidate_below, on_delete=disk.delete,
                       is_clean=disk.has, exists=disk.exists,
                       on_delete_version=disk.delete_version)


# ---------------------------------------------------------------- lock order
class LockRank(enum.IntEnum):
    """Take these locks in ascending rank only (a thread holding DISK never takes MEMORY)."""

    MEMORY = 1  # MemoryTier: index, allocator, leases
    DISK = 2  # SegmentLog: index, segment table, namespaces


_held = threading.local()


class _RankedLock:
    """A lock that refuses to be taken against ``LockRank`` (tests; ``lock_order`` on)."""

    __slots__ = ("_lock", "rank")

    def __init__(self, rank: LockRank) -> None:
        self._lock = threading.Lock()
        self.rank = rank

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        ranks = _held.__dict__.setdefault("ranks", [])
        if ranks and ranks[-1] >= self.rank:
            raise WiringError(f"lock {self.rank.name} taken while holding "
                              f"{LockRank(ranks[-1]).name}; the order is "
                              f"{' -> '.join(r.name for r in LockRank)}")
        ok = self._lock.acquire(blocking, timeout)
        if ok:
            ranks.append(self.rank)
        return ok

    def release(self) -> None:
        _held.ranks.remove(self.rank)  # ranks held are ascending: each at most once
        self._lock.release()

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def ranked_lock(rank: LockRank) -> Any:
    """The lock of the side of ``rank``: a plain ``threading.Lock`` (no cost), or a
    checking one when the ``lock_order`` failpoint is on as it is made."""
    return _RankedLock(rank) if failpoint("lock_order") else threading.Lock()


# ---------------------------------------------------------------- the two sides
#: ``dest`` of ``DiskSide.read_many``: for a record of n bytes, a writable page-aligned
#: view of n bytes and its token, or None when there is no room
ScratchSource = Callable[[int], "tuple[memoryview, Any] | None"]


class MemorySide(Protocol):
    """What the mover may call on the memory tier (and nothing else).

    The ``Tier`` methods (``pin_read``/``unpin``/``begin_put``/``finish_put``/
    ``abort_put``/``release_holder``/``exists``/``touch``/``delete``) run on connection
    threads and never block on IO; ``begin_put`` may wait briefly for reservation room.
    """

    capacity: int  # arena bytes
    max_object: int
    high: float  # watermarks, fractions of capacity
    low: float
    live_bytes: int  # allocated chunk bytes (read without the lock: a hint)
    uncommitted_bytes: int  # of which puts in flight
    quotas: QuotaStore | None
    pressure: threading.Event  # set when memory wants the mover (watermark, quota, room)

    # -- startup (before any other thread runs)
    def attach(self, hooks: MemoryHooks) -> None:
        """Install the tier-below hooks, once (WiringError if already attached)."""

    def versions(self) -> dict[tuple[bytes, bytes], int]:
        """The version of every resident key."""

    def delete_if_version(self, ns: bytes, key: bytes, version: int) -> bool:
        """Drop the key if its current object is ``version``, in memory and (through
        ``on_delete_version``, same lock hold) below (True if dropped). Also startup."""

    def bump_version(self, at_least: int) -> None:
        """Never hand out a version below ``at_least``."""

    # -- connection threads (Tier contract); the mover's use is noted
    def pin_read(self, ns: bytes, key: bytes, offset: int, max_len: int,
                 expect_version: int) -> Pinned: ...

    def pin_read_many(self, ns: bytes, items: list[tuple[bytes, int, int, int]]
                      ) -> list[Pinned]: ...

    def unpin(self, pinned: Pinned) -> None: ...

    def unpin_many(self, pins: list[Pinned]) -> None: ...

    def reserve_scratch(self, nbytes: int, holder: Any) -> tuple[memoryview, Any] | None:
        """An unpublished, page-aligned chunk of the arena for ``nbytes`` read from below,
        charged to ``holder`` (its bounds as for reservations; never evicts): a view of
        its first ``nbytes`` and its token; None without room."""

    def release_scratch(self, token: Any) -> None:
        """Free a ``reserve_scratch`` chunk (any thread)."""

    def begin_put(self, ns: bytes, key: bytes, total_len: int, offset: int, length: int,
                  put_id: int, evict: bool = True, *, csum: int | None = None,
                  holder: Any = None, ph: int | None = None,
                  parent: bytes | None = None) -> PutSlot:
        """``evict=False``: NO_SPACE instead of evicting (``extra["quota"]``: the
        namespace's quota is what is full), so the mover can demote first."""

    def finish_put(self, slot: PutSlot, *, if_absent: bool = False,
                   digest: int | None = None) -> Status:
        """Commit; runs ``on_publish`` under the memory lock. ``if_absent``: publish
        only if neither memory nor ``exists`` below has the key (same lock hold)."""

    def abort_put(self, slot: PutSlot, quarantine: Any = None) -> None: ...

    def release_holder(self, holder: Any) -> None: ...

    def exists(self, ns: bytes, key: bytes) -> bool: ...

    def touch(self, ns: bytes, key: bytes) -> bool: ...

    def delete(self, ns: bytes, key: bytes) -> bool:
        """Runs ``on_delete`` under the memory lock (True if either tier had it)."""

    def object_bytes(self, ns: bytes, key: bytes, length: int) -> int:
        """Bytes an allocation for this object needs (any thread, no lock)."""

    def has_room(self, need: int) -> bool:
        """Whether a ``need`` byte allocation would fit without evicting (no lock: a
        hint)."""

    def want_quota_room(self, ns: bytes, need: int) -> None:
        """A put waits for a ``need`` byte allocation within ``ns``'s quota: queue the
        namespace for the mover."""

    def admit(self, ns: bytes, key: bytes, data: memoryview, version: int, csum: int,
              still_valid: Callable[[], bool], ph: int | None = None) -> bool:
        """Promotion (connection thread after a reply, or the mover): copy a verified
        object in under its own version and placement hash, into free space only. ``still_valid`` runs
        under the memory lock (it may take the disk's). Copies outside the lock."""

    # -- the handoff worker
    def held(self) -> Iterator[HeldObject]:
        """Memory's committed objects, a chunked snapshot (``tier.held_snapshot``)."""

    # -- the mover
    def claim_cold(self, max_bytes: int, max_items: int = 4096,
                   ns: bytes | None = None) -> list[ColdObject]:
        """Pin up to ``max_bytes`` of the first objects to give up (of ``ns`` only)."""

    def data_view(self, cold: ColdObject) -> memoryview:
        """The claimed object's bytes (release the view before ``finish_demotion``)."""

    def finish_demotion(self, cold: ColdObject, publish: Callable[[], bool] | None,
                        corrupt: bool = False) -> bool:
        """Release a claim; drop the object from memory (True) if it is still current
        and ``publish()`` (run under the memory lock; it may take the disk's) says the
        disk copy is now visible. ``corrupt``: its bytes failed their checksum: drop."""

    def expire_pending(self) -> None:
        """Reclaim sliced puts that stalled past their timeout."""

    def snapshot_recency_if_due(self) -> int:
        """Save the eviction order in the arena when ``recency_snapshot_s`` has passed
        (so a crash restarts with it); how many objects, 0 when not due. Takes the
        memory lock in short holds."""

    def evict_to_low(self) -> None:
        """Evict to nothing down to the low watermark (memory-only fallback)."""

    def evict_ns(self, ns: bytes, nbytes: int) -> int:
        """Evict at least ``nbytes`` of ``ns``'s own objects; the bytes freed."""

    def quota_wants(self) -> list[tuple[bytes, int]]:
        """Namespaces to bring down: ``(ns, bytes to shed)``; forgets them."""

    def quota_event(self, event: str, ns: bytes, n: int) -> None:
        """Count a quota event for ``ns`` (``disk_evicted``: the mover killed disk
        records for the namespace's disk quota)."""

    # -- any thread
    def stats(self) -> dict[str, int | float]: ...

    def namespace_usage(self) -> dict[bytes, tuple[int, int]]: ...

    def close(self, clean: bool = True) -> None:
        """After the mover stopped."""


class DiskSide(Protocol):
    """What the mover (and memory's hooks) may call on the disk tier (and nothing else).

    The disk never calls the memory tier. Methods marked "memory lock may be held"
    take only the disk's own lock and never do IO beyond a small death record.
    """

    degraded: str  # why writes stopped ("" while healthy); reads keep working
    max_record: int  # bytes of the largest record
    max_version: int  # highest version ever written (startup: versions start above it)

    # -- startup
    def supersede(self, versions: Mapping[tuple[bytes, bytes], int]
                  ) -> tuple[int, list[tuple[bytes, bytes, int]]]:
        """One version per key: kill each disk record older than ``versions``' version
        of its key; return how many died and the ``(ns, key, version)`` of ``versions``
        the disk holds a newer record of."""

    # -- connection threads and IO threads (block on IO)
    def read(self, ns: bytes, key: bytes, offset: int, max_len: int,
             expect_version: int) -> Pinned:
        """Read and verify (part of) a record; the token is a ``ReadLease``."""

    def read_many(self, ns: bytes, items: list[tuple[bytes, int, int, int]],
                  dest: ScratchSource | None = None) -> list[Pinned]:
        """``read`` for items ``(key, offset, max_len, expect_version)`` of ``ns``, in
        order: a pin per item, each as ``read`` would give it. ``dest``: each whole
        record is read into ``dest(record bytes)`` (``ReadLease.scratch``); an item it
        has no room for, or that is not read whole, answers BUSY unread."""

    def release(self, lease: ReadLease | None) -> None:
        """Give a read's buffer back (any thread, never blocks)."""

    # -- any thread, never block on IO; memory lock may be held
    def exists(self, ns: bytes, key: bytes) -> bool: ...

    def touch(self, ns: bytes, key: bytes) -> bool: ...

    def has(self, ns: bytes, key: bytes, version: int) -> bool:
        """The disk holds exactly this version (``is_clean``, ``still_valid``)."""

    def delete(self, ns: bytes, key: bytes) -> bool:
        """Kill the key's record, persisting its death (``on_delete``)."""

    def delete_version(self, ns: bytes, key: bytes, version: int) -> bool:
        """Kill the key's record if it is ``version`` (``on_delete_version``)."""

    def invalidate_below(self, ns: bytes, key: bytes, version: int) -> bool:
        """Kill the key's record if older than ``version`` (``on_publish``)."""

    def publish(self, ns: bytes, key: bytes, written: Any) -> bool:
        """Make a written record visible; the higher version wins (True if it is live).
        Run from ``finish_demotion``'s ``publish``, memory lock held."""

    # -- the mover only (the disk's one writer)
    def append(self, items: list[DemoteItem]) -> list[Any]:
        """Write records; per item a written handle or a Status. Blocks on IO."""

    def discard(self, ns: bytes, key: bytes, written: Any) -> None:
        """A written record that was not published (memory changed meanwhile): record
        its death, unless it is the live one."""

    def read_whole(self, ns: bytes, key: bytes, version: int) -> Pinned:
        """A verified whole-object read (promotion); neither a hit nor a use."""

    def record_bytes(self, ns: bytes, key: bytes, length: int, placed: bool = False) -> int:
        """Disk bytes a record of this object takes (for disk quotas; ``placed``: with a
        placement hash)."""

    def fit_quota(self, ns: bytes, limit: int, want: int) -> tuple[int, bool]:
        """Kill ``ns``'s oldest records until its live bytes plus ``want`` fit ``limit``;
        return how many died and whether it fits now."""

    def namespace_bytes(self) -> dict[bytes, int]:
        """Live record bytes per namespace (any thread)."""

    def held(self) -> Iterator[HeldObject]:
        """The live records, a chunked snapshot (``tier.held_snapshot``; the handoff
        worker, never blocks on IO)."""

    def probe(self) -> bool:
        """Try to leave the degraded state (IO)."""

    def needs_compaction(self) -> bool: ...

    def compact_one(self, policy: Any = None) -> dict[str, int]:
        """Reclaim one segment (``tiering.CompactionPolicy``). Blocks on IO."""

    def stats(self) -> dict[str, int]: ...

    def close(self, clean: bool = True) -> None:
        """After the mover stopped."""
