"""Memory tier: allocator, index, eviction and read leases over an Arena.

Design. An object is one chunk: header + data, a run of whole 4 KiB granules sized to
it (``arena.size_class``) anywhere in the arena (``extents.ExtentAllocator``: free runs
merge with their neighbours, so values of any mix of sizes pack the arena; equal-chunk
slab pages per size class stranded most of it under mixed sizes: slab calcification).
A chunk is at most ``slab_bytes``. After a restart the free runs are the complement of
the recovered chunks.

* Index: a plain dict ``(ns, key) -> _Obj`` of committed objects. The order
  in which they are given up is the eviction policy's (``eviction.EvictionPolicy``,
  LRU by default): the tier tells it of every index change and hit (``touch``
  refreshes recency without moving data) and asks it for ``candidates`` when it
  needs room, skipping pinned and claimed ones itself.
* Eviction: a background thread keeps live bytes between the low and high
  watermarks; an allocation that still finds no free run long enough evicts the
  policy's unpinned candidates synchronously, in order, until one is (bounded). When
  the free bytes would do but are split into holes (churn), it first compacts
  (``do_compact``, counted in ``relocated``): it copies the objects right after the
  longest free run into other holes, so the run grows, instead of evicting in policy
  order until a run happens to be long enough (10x the chunk's size after small-value
  churn); one that no hole takes is evicted (``evicted_for_room``: the one eviction
  out of the policy's order, bounded by the chunk's size). Only current, committed,
  unpinned, unclaimed objects move, keeping their
  ``_Obj`` (the policy and index see nothing), version, checksum and creation time;
  the new copy is committed before the old one is cleared, so a crash leaves one of
  two identical copies (recovery keeps one).
* Leases: ``pin_read`` bumps a pin count; delete, replace and eviction of a
  pinned object only mark it doomed and the last ``unpin`` frees it, so a
  transfer never reads freed bytes. A GET frame pins and unpins all its items
  with one lock hold each (``pin_read_many`` / ``unpin_many``); views are cut
  and first reads verified outside the lock.
* Puts: ``begin_put`` allocates an uncommitted chunk; sliced puts (several
  frames, maybe several connections) share one pending chunk keyed by
  ``(ns, key, put_id)``. Each slice claims its byte range ``[offset, offset+length)``;
  a slice that is empty or overlaps a range already claimed is refused
  (BAD_REQUEST), so the received ranges never overlap and the object commits exactly
  when they cover ``[0, total_len)``: every byte was written by that put. Pending
  puts that stall past ``pending_put_timeout_ms`` are reclaimed.
* Reservations. A reservation that may outlive its request (an ALLOC slot, a sliced
  put waiting for more slices) names a ``Holder``: the connection that answers for
  it. Its chunk is charged to the holder and to its namespace until it commits or is
  freed; a new one is refused with BUSY past ``max_held_bytes`` per holder or
  ``max_reserved_bytes`` in total, so one writer can never reserve the arena away.
  ``release_holder`` (connection closed) fails every incomplete sliced put the holder
  contributed to and frees its quarantined chunks. A quarantined chunk (an ALLOC slot
  expired while its writer may still be copying into it) stays allocated and charged
  to that holder until it closes, so a late write can never land in another object.
  ``reserved_by_ns`` is the reserved part of each namespace's bytes.
* Quotas (``gcache.quotas``, optional). Every allocated chunk is charged to its
  namespace (``_ns``: committed objects, puts in flight, ALLOC slots and
  quarantined chunks, so reservations count against the writer's quota). A new put
  that would take its namespace past ``memory_bytes`` first evicts that namespace's
  own objects, in the policy's order (``candidates(ns)``, ``do_quota_room``); if they
  do not make room it answers NO_SPACE (``PutSlot.extra["quota"]``, counted in
  ``quota_refused``). It never evicts another namespace for it. A namespace past ``high_watermark`` of its
  quota is queued (``quota_wants``) and brought down to ``low_watermark`` of it in the
  background: evicted here, demoted by the tiered store's mover. Under global pressure
  eviction follows the policy over everyone, except that namespaces over their quota
  (after a reload lowered it, or a restart) go first. Promotion (``admit``) never takes a
  namespace past its quota. After a restart the accounting is rebuilt from the
  recovered index.

* Placement hashes (``tier`` docstring). ``begin_put(ph=)`` (the slice that creates a
  sliced put's chunk) and ``admit(ph=)`` keep the hash in ``_Obj.ph`` and the chunk
  header (``arena.FLAG_PLACED``: a header 8 bytes longer, so ``object_bytes`` counts
  them); recovery reads it back, ``claim_cold`` hands it to the disk (``ColdObject.ph``)
  and ``held`` yields it.
* Tiering: this is the memory side of ``movement`` (``MemorySide``); the
  tiered store's mover drives it through that contract only. Its hooks
  (``movement.MemoryHooks``, given once by ``attach``) all run with
  ``self._lock`` held, so they are atomic with the index change: ``on_publish``
  after a put replaced the index entry, ``on_delete`` inside a delete,
  ``is_clean`` to prefer objects that already have a disk copy when an
  allocation must evict synchronously. ``claim_cold``/``finish_demotion`` pin
  and then hand over the policy's first candidates (``movement.ColdObject``);
  ``admit`` copies a verified disk object back in under its original version
  (promotion).

* Recency across restarts: every ``recency_snapshot_s`` (default 10 s; 0: only at a
  clean stop) the evictor thread (with a disk tier, the tiered store's mover:
  ``snapshot_recency_if_due``) writes each object's place in the policy's order into
  its chunk header (``arena`` docstring: ranks only grow, and a record in the
  superblock), hottest first, 1024 objects per lock hold, so a crash (kill -9)
  restarts with the order of at most one period before it; objects put since then
  come after every ranked one, oldest first. Cost (``snapshot_recency``): one ``list``
  of the policy's ``saved_order`` under the lock (a C-level copy: 30-60 ms per 100k
  objects on a loaded 2-core machine), then ~2 us per object in
  1024-object lock holds (~0.7 ms each): ~0.2 s of one core per 100k resident objects
  per period (``python -m gcache.bench.recency_cost``).

``do_`` methods require the caller to hold ``self._lock`` (``LockRank.MEMORY``:
taken before the disk's, never after).
"""

from __future__ import annotations

import bisect
import itertools
import logging
import struct
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Iterator

from gcache.errors import WiringError
from gcache.hashing import checksum
from gcache.quotas import QuotaStore
from gcache.status import Status
from gcache.server.arena import (GRANULE, RANK_MAX, Arena, HDR_FIXED, header_len,
                                  size_class)
from gcache.server.eviction import LRU, EvictionPolicy
from gcache.server.extents import ExtentAllocator
from gcache.server.movement import ColdObject, LockRank, MemoryHooks, ranked_lock
from gcache.server.tier import HeldObject, Pinned, PutRequest, PutSlot, Tier, held_snapshot

if TYPE_CHECKING:
    from gcache.server.kv_events import EventQueue
    from gcache.server.mrc import AccessObserver

log = logging.getLogger("gcache.server.memory")

_EVICT_SYNC_LIMIT = 100_000
#: items the batched put calls reserve, count in or publish per hold of the tier lock: a
#: frame of a thousand small values must not keep the other connections' reads and puts
#: off the lock for the whole frame (~10 us an item here), only for a slice of it
LOCK_BATCH = 64
_RANK_BATCH = 1024  # objects per lock hold of a recency snapshot (~0.7 ms)
_OK = Status.OK  # an enum attribute lookup costs more than a global one, per item


@dataclass(slots=True, eq=False)
class _Obj:
    ns: bytes
    key: bytes
    offset: int
    chunk: int
    data_off: int
    length: int
    version: int
    checksum: int = 0
    pins: int = 0
    doomed: bool = False
    committed: bool = False
    verified: bool = True  # recovered objects are verified on first read
    moving: bool = False  # claimed by the tiering mover
    holder: Holder | None = None  # charged with this uncommitted chunk
    quarantined: bool = False  # an expired slot's chunk: freed when its holder closes
    ph: int | None = None  # placement hash its writer routed it by (None: not sent)
    parent: bytes | None = None  # its chain parent's key, if its writer said (not persisted)


@dataclass(slots=True, eq=False)
class Scratch:
    """A ``reserve_scratch`` chunk: its arena offset, size and holder."""

    off: int
    chunk: int
    holder: Holder
    freed: bool = False  # under the tier lock


class _WaitForRoom(Exception):
    """begin_put: no reservation room yet, wait (lock released) and retry."""


class Holder:
    """Who answers for reservations that outlive a request: one per connection.

    ``held``: chunk bytes charged to it (uncommitted objects it created with this holder,
    quarantined chunks included). ``pendings``: incomplete sliced puts it contributed to.
    Fields are guarded by the MemoryTier lock.
    """

    __slots__ = ("held", "pendings", "quarantine", "closed", "wait_until", "no_wait_until",
                 "__weakref__")

    def __init__(self) -> None:
        self.held = 0
        self.pendings: set = set()
        self.quarantine: list = []
        self.closed = False
        self.wait_until: float | None = None  # end of the back-pressure wait under way
        self.no_wait_until = 0.0  # after a back-pressure wait ran out: BUSY at once until


@dataclass(slots=True, eq=False)
class _Pending:
    obj: _Obj
    received: int = 0
    deadline: float = 0.0
    failed: bool = False
    expect: int | None = None  # the writer's checksum of the whole value
    if_absent: bool = False  # a slice asked to publish only if the key is absent
    key: tuple = ()  # (ns, key, put_id) of a sliced put
    holders: set = field(default_factory=set)  # holders that contributed slices
    ranges: list = field(default_factory=list)  # claimed [start, end), sorted, disjoint

    def claim(self, start: int, end: int) -> bool:
        """Claim ``[start, end)`` for one slice; False if it is empty or overlaps a claim."""
        r = self.ranges
        i = bisect.bisect_left(r, (start, end))
        if end <= start or (i and r[i - 1][1] > start) or (i < len(r) and r[i][0] < end):
            return False
        r.insert(i, (start, end))
        return True


class MemoryTier(Tier):
    def __init__(self, arena: Arena, *, high_watermark: float = 0.95,
                 low_watermark: float = 0.90, pending_put_timeout_ms: int = 10_000,
                 clock: Callable[[], float] = time.monotonic,
                 on_evict: Callable[[int, int], None] | None = None,
                 max_held_bytes: int | None = None,
                 max_reserved_bytes: int | None = None,
                 quotas: QuotaStore | None = None,
                 on_quota: Callable[[str, bytes, int], None] | None = None,
                 eviction_policy: EvictionPolicy | None = None,
                 access_observer: AccessObserver | None = None,
                 recovery_progress: Callable[[int, int], None] | None = None,
                 recency_snapshot_s: float = 10.0,
                 events: EventQueue | None = None) -> None:
        """``recovery_progress(done, total)``: the reused arena's scan, chunks checked
        (the start-up log). ``quotas``: per-namespace limits (None: unlimited). ``on_quota(event, ns, n)``
        counts quota events per namespace (``refused``, ``evicted``); it runs with the
        lock held and must not block. ``eviction_policy``: the order objects are given
        up in (default LRU; see ``eviction``). ``access_observer``: hears every
        whole-object read, hit or miss, and every published put, with the lock held, and
        every EXISTS, without it (``mrc.AccessObserver``; the miss-ratio curve).
        ``recency_snapshot_s``: how often the evictor saves the policy's order in the
        arena (0: only at a clean stop; see the module docstring).
        ``events``: told of every index change after recovery (``kv_events``: an object
        now current, or gone: evicted, demoted, deleted), with the lock held."""
        self.arena = arena
        self.access_observer = access_observer
        self.recovery_progress = recovery_progress
        self.policy = eviction_policy if eviction_policy is not None else LRU()
        self.quotas = quotas
        self.on_quota = on_quota
        self.high, self.low = high_watermark, low_watermark
        self.pending_timeout = pending_put_timeout_ms / 1000.0
        self.clock = clock
        self.on_evict = on_evict
        self.recency_snapshot_s = recency_snapshot_s
        self._next_snapshot = clock() + recency_snapshot_s
        self._next_rank = 1  # _recover: past every rank in the arena
        self.capacity = arena.npages * arena.slab_bytes
        self.max_object = arena.slab_bytes
        # reservations that may outlive a request: per holder (connection), and in total
        self.max_held = max_held_bytes or max(arena.slab_bytes, self.capacity // 4)
        self.max_reserved = max_reserved_bytes or max(arena.slab_bytes, self.capacity // 2)
        self.reserve_wait_s = 1.0  # back-pressure on a reservation past its bounds
        self.reserved_bytes = 0
        self.scratch_bytes = 0  # of which reserve_scratch chunks (disk reads leased out)
        self.reserved_by_ns: dict[bytes, int] = {}  # the writer's quota plugs in here
        self._lock = ranked_lock(LockRank.MEMORY)
        self._index: dict[tuple[bytes, bytes], _Obj] = {}
        self._ns: dict[bytes, int] = {}  # chunk bytes per namespace with allocated chunks
        self._over: set[bytes] = set()  # past their quota (a reload lowered it, a restart)
        self._quota_wants: dict[bytes, int] = {}  # ns -> bytes a put waits for (0: none)
        self._quota_gen = -1
        self._pending: dict[tuple[bytes, bytes, int], _Pending] = {}
        self._extents = ExtentAllocator(0)  # the free runs; _recover builds them
        self._next_version = max(1, arena.next_version)
        self.live_bytes = 0  # chunk bytes of committed + pending objects
        self.uncommitted_bytes = 0  # of which not committed yet (puts in flight)
        self.counters = {"evictions": 0, "evicted_bytes": 0, "corrupt_dropped": 0,
                         "torn_dropped": 0, "recovered": 0, "pending_expired": 0,
                         "no_space": 0, "clean_dropped": 0, "put_checksum_mismatch": 0,
                         "reservations_refused": 0, "pending_released": 0,
                         "quarantined": 0, "quota_refused": 0, "quota_evictions": 0,
                         "put_if_absent_skipped": 0, "relocated": 0,
                         "evicted_for_room": 0, "scratch_reserved": 0, "scratch_refused": 0}
        self._on_publish: Callable[[bytes, bytes, int], object] | None = None  # attach()
        self._on_delete: Callable[[bytes, bytes], bool] | None = None
        self._is_clean: Callable[[bytes, bytes, int], bool] | None = None
        self._exists_below: Callable[[bytes, bytes], bool] | None = None
        self._on_delete_version: Callable[[bytes, bytes, int], bool] | None = None
        self._stop = threading.Event()
        self.pressure = threading.Event()  # set when live bytes pass the high watermark
        self._evictor: threading.Thread | None = None
        self._events: EventQueue | None = None  # recovered objects are announced apart
        self._recover()
        self._events = events

    # ------------------------------------------------------------------ startup
    def _recover(self) -> None:
        t0 = time.monotonic()
        if self.arena.reused:
            objs, counts = self.arena.scan(self.recovery_progress)
        else:
            objs, counts = [], {"torn": 0, "corrupt": 0, "superseded": 0}
        # the policy's order at the last recency snapshot or clean stop (ranks only
        # grow, so an older snapshot's rank sorts first); objects put since (rank 0)
        # after them, oldest first, so the policy sees them age
        objs.sort(key=lambda r: (r.rank or 1 << 32, r.created_ns))
        snap = self.arena.snapshot_record() if self.arena.reused else (0, 0, 0, 0)
        self._next_rank = max(snap[3], max((r.rank for r in objs), default=0) + 1, 1)
        used: list[tuple[int, int]] = []
        for r in objs:
            used.append((self.arena.granule_of(r.offset), r.chunk // GRANULE))
            o = _Obj(r.ns, r.key, r.offset, r.chunk, r.data_off, r.length, r.version,
                     r.checksum, committed=True, verified=False, ph=r.ph)
            self.do_charge_ns(r.ns, r.chunk)
            self.do_link(o)
            self.live_bytes += r.chunk
            self._next_version = max(self._next_version, r.version + 1)
        self._extents = ExtentAllocator.from_used(self.arena.granules, used)
        self.counters["recovered"] = len(objs)
        self.do_refresh_quotas()  # a restart under a smaller quota: those go first
        self.counters["corrupt_dropped"] = counts["corrupt"]
        self.counters["torn_dropped"] = counts["torn"]
        self.recovery = {
            "reused": self.arena.reused, "was_clean": self.arena.was_clean,
            "reason": self.arena.reuse_reason, "objects": len(objs),
            "torn": counts["torn"], "corrupt": counts["corrupt"],
            "superseded": counts["superseded"], "seconds": time.monotonic() - t0,
            "recency_snapshot_age_s": ((time.time_ns() - snap[1]) / 1e9 if snap[1]
                                       else None),
        }

    def attach(self, hooks: MemoryHooks) -> None:
        """Install the hooks of the tier below (``movement``), once, before ``start``."""
        if self._on_publish is not None:
            raise WiringError("the memory tier's hooks are attached already; build one "
                              "TieredStore per MemoryTier")
        (self._on_publish, self._on_delete, self._is_clean, self._exists_below,
         self._on_delete_version) = hooks

    def start(self) -> None:
        self._evictor = threading.Thread(target=self._evict_loop, name="gcache-evictor",
                                         daemon=True)
        self._evictor.start()

    # ------------------------------------------------------------------ allocator
    @staticmethod
    def object_bytes(ns: bytes, key: bytes, length: int) -> int:
        """Bytes an allocation for this object needs (header, with room for a placement
        hash, and value; before rounding to its size class): at most 8 bytes over."""
        return header_len(len(ns), len(key), True) + length

    def has_room(self, need: int) -> bool:
        """Whether an allocation of ``need`` bytes would succeed without evicting (a hint:
        read without the lock)."""
        return self._extents.fits(size_class(need) // GRANULE)

    def do_alloc(self, need: int, evict: bool = True) -> int | None:
        """A chunk for ``need`` bytes (its header is the caller's to write), evicting in
        the policy's order while no free run is long enough (``evict``); None if none."""
        csize = size_class(need)
        if csize > self.arena.slab_bytes:
            return None
        n = csize // GRANULE
        evicted = tries = 0
        freed_from = self.live_bytes
        made = None
        while True:
            g = self._extents.alloc(n) if made is None else self._extents.alloc_at(made, n)
            made = None
            if g is not None:
                self.live_bytes += csize
                return self.arena.granule_offset(g)
            if not evict or evicted >= _EVICT_SYNC_LIMIT:
                return None
            if tries < 8 and freed_from - self.live_bytes >= csize:
                tries += 1  # policy order freed the bytes, but split: make one run of them
                made = self.do_compact(n)
                if made is not None:
                    continue
            if not self.do_evict_one():
                return None
            evicted += 1

    def do_charge(self, holder: Holder, o: _Obj) -> bool:
        """Charge ``o``'s chunk to ``holder`` and its namespace; False past a bound."""
        if (holder.held + o.chunk > self.max_held
                or self.reserved_bytes + o.chunk > self.max_reserved):
            self.counters["reservations_refused"] += 1
            return False
        o.holder = holder
        holder.held += o.chunk
        self.reserved_bytes += o.chunk
        self.reserved_by_ns[o.ns] = self.reserved_by_ns.get(o.ns, 0) + o.chunk
        return True

    def do_uncharge(self, o: _Obj) -> None:
        h, o.holder = o.holder, None
        if h is None:
            return
        h.held -= o.chunk
        self.reserved_bytes -= o.chunk
        left = self.reserved_by_ns.get(o.ns, 0) - o.chunk
        if left > 0:
            self.reserved_by_ns[o.ns] = left
        else:
            self.reserved_by_ns.pop(o.ns, None)

    def do_drop_pending(self, pend: _Pending) -> None:
        """The sliced put is over (committed, failed, expired): forget it."""
        if pend.key and self._pending.get(pend.key) is pend:
            del self._pending[pend.key]
        for h in pend.holders:
            h.pendings.discard(pend)
        pend.holders.clear()

    def do_free(self, o: _Obj) -> None:
        self.do_uncharge(o)
        left = self._ns[o.ns] - o.chunk
        if left > 0:
            self._ns[o.ns] = left
        else:
            del self._ns[o.ns]
            self._over.discard(o.ns)
        self.arena.clear(o.offset)
        self._extents.release(self.arena.granule_of(o.offset), o.chunk // GRANULE)
        self.live_bytes -= o.chunk
        if not o.committed:
            self.uncommitted_bytes -= o.chunk

    def do_evict_one(self, ns: bytes | None = None) -> bool:
        """Evict the policy's first unpinned candidate (of namespace ``ns`` only, when
        given: a quota eviction). False if none.

        Without ``ns``, a namespace over its quota gives up its own first candidate first.
        With ``is_clean`` attached (a disk tier behind us), an object among the first
        candidates that already has an identical disk copy goes first: dropping it loses
        nothing.
        """
        if ns is None:
            for over in list(self._over):
                if self.do_over_quota(over) and self.do_evict_one(over):
                    return True
                self._over.discard(over)
        candidates = self.policy.candidates
        victim = None
        if self._is_clean is not None:
            for n, o in enumerate(candidates(ns)):
                if n >= 256:
                    break
                if o.pins == 0 and self._is_clean(o.ns, o.key, o.version):
                    victim = o
                    self.counters["clean_dropped"] += 1
                    break
        if victim is None:
            for o in candidates(ns):
                if o.pins == 0:
                    victim = o
                    self.counters["evictions"] += 1
                    self.counters["evicted_bytes"] += o.length
                    if self.on_evict:
                        self.on_evict(1, o.length)
                    break
                # pinned: skip it (it stays at the head; the scan is short in practice)
        if victim is None:
            return False
        self.do_unindex(victim)
        self.do_free(victim)
        if ns is not None:
            self.counters["quota_evictions"] += 1
            if self.on_quota is not None:
                self.on_quota("evicted", ns, 1)
        return True

    def do_compact(self, n: int) -> int | None:
        """Make a free run of ``n`` granules by moving the objects right after the
        longest free run into other holes (one no hole takes is evicted); returns the
        run's first granule. None, with nothing moved, when an object in the way may not move (pinned, claimed, a put in
        flight) or the window would pass the arena's end."""
        ext, arena = self._extents, self.arena
        start, length = ext.largest_run()
        if not length or start + n > arena.granules:
            return None
        movers = []
        holes = [(start, length)]
        g = start + length
        while g < start + n:  # chunks and free runs up to the window's end
            run = ext.free_run_at(g)
            if run:
                holes.append((g, run))
                g += run
                continue
            o = self.do_object_at(arena.granule_offset(g))
            if o is None or o.pins or o.moving:
                return None
            movers.append(o)
            g += o.chunk // GRANULE
        for h, _ in holes:
            ext.take_run(h)  # so no mover lands in the window
        try:
            for o in movers:
                at = arena.granule_of(o.offset)
                if not self.do_relocate(o):  # no hole takes it: it goes, out of order
                    self.counters["evicted_for_room"] += 1
                    self.counters["evictions"] += 1
                    self.counters["evicted_bytes"] += o.length
                    if self.on_evict:
                        self.on_evict(1, o.length)
                    self.do_unindex(o)
                    self.do_free(o)
                holes.append((at, ext.take_run(at)))  # its old chunk: no later mover's
        finally:
            for h, m in holes:
                ext.release(h, m)
        return start

    def do_relocate(self, o: _Obj) -> bool:
        """Copy ``o`` (current, committed, unpinned) into another hole; False if none."""
        g = self._extents.alloc(o.chunk // GRANULE)
        if g is None:
            return False
        arena, old = self.arena, o.offset
        dst = arena.granule_offset(g)
        created = struct.unpack_from("<Q", arena.mm, old + 40)[0]
        data_off = arena.write_header(dst, o.ns, o.key, o.version, o.length, created, o.ph)
        arena.set_rank(dst, arena.rank(old))
        arena.buf[data_off:data_off + o.length] = arena.buf[o.data_off:o.data_off + o.length]
        arena.commit(dst, o.checksum)  # the new copy first: a crash leaves one of two
        arena.clear(old)
        self._extents.release(arena.granule_of(old), o.chunk // GRANULE)
        o.offset, o.data_off = dst, data_off
        self.counters["relocated"] += 1
        return True

    def do_object_at(self, off: int) -> _Obj | None:
        """The current committed object whose chunk starts at ``off``, else None."""
        mm = self.arena.mm
        ns_len, key_len = struct.unpack_from("<HH", mm, off + 10)
        p = off + HDR_FIXED
        k = (bytes(mm[p:p + ns_len]), bytes(mm[p + ns_len:p + ns_len + key_len]))
        o = self._index.get(k)
        return o if o is not None and o.offset == off else None

    # ------------------------------------------------------------------ quotas
    def do_charge_ns(self, ns: bytes, chunk: int) -> None:
        """A ``chunk`` was allocated for ``ns`` (``do_free`` gives it back)."""
        self._ns[ns] = self._ns.get(ns, 0) + chunk

    def do_link(self, o: _Obj) -> _Obj | None:
        """Make ``o`` the current (newest) object of its key; returns the one it replaced
        (still allocated: the caller unlinks it)."""
        k = (o.ns, o.key)
        old = self._index.get(k)
        self._index[k] = o
        if old is not None:
            self.policy.on_remove(old)
        self.policy.on_insert(o)
        if self._events is not None:
            self._events.stored(o.ns, o.key, o.parent)
        return old

    def do_unindex(self, o: _Obj) -> None:
        """Remove the current object ``o`` from the index (not freed)."""
        del self._index[(o.ns, o.key)]
        self.policy.on_remove(o)
        if self._events is not None:
            self._events.removed(o.ns, o.key)

    def do_mem_limit(self, ns: bytes) -> int | None:
        return self.quotas.limits(ns).memory_bytes if self.quotas is not None else None

    def do_over_quota(self, ns: bytes, add: int = 0) -> bool:
        limit = self.do_mem_limit(ns)
        return limit is not None and self._ns.get(ns, 0) + add > limit

    def do_quota_room(self, ns: bytes, csize: int, evict: bool) -> bool:
        """Room for a ``csize`` chunk within ``ns``'s memory quota, evicting only that
        namespace's own objects (when ``evict``). False: the put must be refused."""
        limit = self.do_mem_limit(ns)
        if limit is None:
            return True
        while True:
            if self._ns.get(ns, 0) + csize <= limit:
                return True
            if csize > limit or not evict or not self.do_evict_one(ns):
                return False

    def do_refresh_quotas(self) -> None:
        """After a quota reload (or at start): find the namespaces now over their quota."""
        if self.quotas is None or self.quotas.generation == self._quota_gen:
            return
        self._quota_gen = self.quotas.generation
        self._over = {ns for ns in self._ns if self.do_over_quota(ns)}
        for ns in self._over:
            self._quota_wants.setdefault(ns, 0)
        if self._over:
            self.pressure.set()

    def quota_wants(self) -> list[tuple[bytes, int]]:
        """Namespaces to bring down (and forget): ``(ns, bytes)`` each must shed to be at
        ``low_watermark`` of its quota, or to fit the put waiting for it."""
        out = []
        with self._lock:
            self.do_refresh_quotas()
            wants, self._quota_wants = self._quota_wants, {}
            for ns, need in wants.items():
                limit = self.do_mem_limit(ns)
                mem = self._ns.get(ns)
                if limit is None or mem is None:
                    continue
                excess = max(mem - int(self.low * limit), mem + need - limit)
                if excess > 0:
                    out.append((ns, excess))
        return out

    def want_quota_room(self, ns: bytes, need: int) -> None:
        """A put waits for a ``need`` byte allocation within ``ns``'s quota: queue the
        namespace."""
        need = size_class(need)
        with self._lock:
            self._quota_wants[ns] = max(need, self._quota_wants.get(ns, 0))
        self.pressure.set()

    def evict_ns(self, ns: bytes, nbytes: int) -> int:
        """Evict at least ``nbytes`` of ``ns``'s own objects (fewer if none are left
        unpinned); returns the bytes freed."""
        freed = 0
        while freed < nbytes:
            with self._lock:  # small locked batches, so IO threads interleave
                for _ in range(64):
                    before = self._ns.get(ns, 0)
                    if freed >= nbytes or not self.do_evict_one(ns):
                        return freed
                    freed += before - self._ns.get(ns, 0)
        return freed

    def do_unlink(self, o: _Obj) -> None:
        if o.pins:
            o.doomed = True
        else:
            self.do_free(o)

    # ------------------------------------------------------------------ reads
    def pin_read(self, ns: bytes, key: bytes, offset: int, max_len: int,
                 expect_version: int) -> Pinned:
        with self._lock:
            o = self._index.get((ns, key))
            if self.access_observer is not None and not offset:
                self.access_observer.on_get(ns, key, None if o is None else o.length)
            if o is None:
                return Pinned(Status.MISS)
            if expect_version and o.version != expect_version:
                return Pinned(Status.CONFLICT, o.length, o.version)
            self.policy.on_hit(o)
            o.pins += 1
        if not o.verified and not self._verify(o):
            return Pinned(Status.CORRUPT)
        start = min(offset, o.length)
        end = min(o.length, start + max_len)
        view = self.arena.buf[o.data_off + start:o.data_off + end]
        return Pinned(Status.OK, o.length, o.version, view, o, o.checksum)

    def pin_read_many(self, ns: bytes, items: list[tuple[bytes, int, int, int]],
                      views: bool = True) -> list[Pinned]:
        """``pin_read`` of every ``(key, offset, max_len, expect_version)`` of one frame,
        in order, with one lock hold for the whole frame (index lookups, recency, pins);
        views and first-read verification happen after it, outside the lock.
        ``views=False`` (shm LEASE: the client copies, the server never reads the bytes):
        no view is cut, ``Pinned.view`` is None and ``token`` still locates the bytes."""
        index, on_hit = self._index, self.policy.on_hit
        seen = self.access_observer
        found: list[_Obj | Pinned] = []
        with self._lock:
            for key, off, _mx, ev in items:
                o = index.get((ns, key))
                if seen is not None and not off:  # the miss-ratio curve, as pin_read
                    seen.on_get(ns, key, None if o is None else o.length)
                if o is None:
                    found.append(Pinned(Status.MISS))
                elif ev and o.version != ev:
                    found.append(Pinned(Status.CONFLICT, o.length, o.version))
                else:
                    on_hit(o)
                    o.pins += 1
                    found.append(o)
        buf, out = self.arena.buf, []
        for o, (_key, offset, max_len, _ev) in zip(found, items):
            if type(o) is Pinned:
                out.append(o)
            elif not o.verified and not self._verify(o):
                out.append(Pinned(Status.CORRUPT))
            elif not views:
                out.append(Pinned(_OK, o.length, o.version, None, o, o.checksum))
            else:
                start = o.data_off + min(offset, o.length)
                end = min(o.data_off + o.length, start + max_len)
                out.append(Pinned(_OK, o.length, o.version, buf[start:end], o, o.checksum))
        return out

    def unpin_many(self, pins: list[Pinned]) -> None:
        """``unpin`` of every lease of one frame, with one lock hold."""
        objs = []
        for p in pins:
            if p.view is not None:
                p.view.release()
                p.view = None
            if p.token is not None:
                objs.append(p.token)
        if not objs:
            return
        with self._lock:
            for o in objs:
                o.pins -= 1
                if o.pins == 0 and o.doomed:
                    self.do_free(o)

    def _verify(self, o: _Obj) -> bool:
        """First read after a restart: check the data checksum (pinned, outside the lock).

        A mismatch drops the object and counts it; its bytes are never served.
        """
        ok = checksum(self.arena.buf[o.data_off:o.data_off + o.length]) == o.checksum
        with self._lock:
            if ok:
                o.verified = True
                return True
            self.counters["corrupt_dropped"] += 1
            if self._index.get((o.ns, o.key)) is o:
                self.do_unindex(o)
                o.doomed = True
            o.pins -= 1
            if o.pins == 0 and o.doomed:
                self.do_free(o)
        log.error("dropped corrupt object (checksum mismatch)",
                  extra={"fields": {"ns": o.ns, "key": o.key, "bytes": o.length}})
        return False

    def unpin(self, pinned: Pinned) -> None:
        o = pinned.token
        if pinned.view is not None:
            pinned.view.release()
            pinned.view = None
        if o is None:
            return
        with self._lock:
            o.pins -= 1
            if o.pins == 0 and o.doomed:
                self.do_free(o)

    def exists(self, ns: bytes, key: bytes) -> bool:
        found = (ns, key) in self._index
        if self.access_observer is not None:
            self.access_observer.on_exists(ns, key, found)
        return found

    def touch(self, ns: bytes, key: bytes) -> bool:
        with self._lock:
            o = self._index.get((ns, key))
            if o is None:
                return False
            self.policy.on_hit(o)
            return True

    def delete(self, ns: bytes, key: bytes) -> bool:
        with self._lock:
            other = self._on_delete(ns, key) if self._on_delete is not None else False
            o = self._index.get((ns, key))
            if o is None:
                return other
            self.do_unindex(o)
            self.do_unlink(o)
            return True

    # ------------------------------------------------------------------ writes
    def begin_put(self, ns: bytes, key: bytes, total_len: int, offset: int, length: int,
                  put_id: int, evict: bool = True, *, csum: int | None = None,
                  holder: Holder | None = None, ph: int | None = None,
                  parent: bytes | None = None) -> PutSlot:
        """``evict=False``: answer NO_SPACE instead of evicting synchronously (the tiered
        store then waits for demotion and retries). ``csum``: the writer's checksum of the
        whole value; every slice of a sliced put must carry the same one (BAD_REQUEST).
        ``holder``: the connection answering for a reservation that may outlive this
        request (BUSY past its bounds, CLOSED once it closed). ``ph``: the placement hash
        the writer routed the key by, kept with the object (the slice that creates a
        sliced put's chunk sets it); ``parent``: the key of the page before it in its
        chain (``eviction.Resident.parent``), likewise, in memory only."""
        req = PutRequest(key, total_len, offset, length, put_id, csum, holder, ph, parent)
        while True:
            with self._lock:
                try:
                    return self.do_reserve(ns, req, evict)
                except _WaitForRoom:
                    pass
            time.sleep(0.005)  # lock released: reservations in flight may commit

    def begin_puts(self, ns: bytes, reqs: list[PutRequest]) -> list[PutSlot]:
        """``begin_put`` of each request, in order, as many as it can per lock hold: the
        rest, from the first that would wait for reservation room, one by one."""
        return self.begin_rest(ns, reqs, self.begin_prefix(ns, reqs, evict=True))

    def begin_prefix(self, ns: bytes, reqs: list[PutRequest], evict: bool) -> list[PutSlot]:
        """``begin_put`` of the requests in one lock hold, in order, up to the first that
        would wait for reservation room or (``evict=False``) answer NO_SPACE: the slots
        of that prefix. That first one reserved nothing; the caller begins it again
        with ``begin_put``. (One lock hold per ``LOCK_BATCH`` requests.)"""
        slots: list[PutSlot] = []
        for a in range(0, len(reqs), LOCK_BATCH):
            with self._lock:
                for r in reqs[a:a + LOCK_BATCH]:
                    try:
                        slot = self.do_reserve(ns, r, evict)
                    except _WaitForRoom:
                        return slots
                    if slot.status == Status.NO_SPACE and not evict:
                        return slots
                    slots.append(slot)
        return slots

    def do_reserve(self, ns: bytes, req: PutRequest, evict: bool) -> PutSlot:
        """``begin_put`` of ``req`` with the lock held; raises ``_WaitForRoom`` when its
        holder may wait for reservation room (the caller retries with the lock
        released)."""
        key, total_len, offset, length, put_id, csum, holder, ph, parent = req
        need = header_len(len(ns), len(key), ph is not None) + total_len
        csize = size_class(need)
        if csize > self.arena.slab_bytes:
            return PutSlot(Status.TOO_LARGE)
        sliced = not (offset == 0 and length == total_len)
        if sliced and length == 0:
            return PutSlot(Status.BAD_REQUEST)  # an empty slice writes nothing
        if holder is not None and holder.closed:
            return PutSlot(Status.CLOSED)
        pend = self._pending.get((ns, key, put_id)) if sliced else None
        if pend is None:
            if holder is not None and (
                    holder.held + csize > self.max_held
                    or self.reserved_bytes + csize > self.max_reserved):
                if self.do_wait_for_room(holder, csize):
                    raise _WaitForRoom
                self.counters["reservations_refused"] += 1
                return PutSlot(Status.BUSY)  # before evicting anything for it
            if holder is not None:
                holder.wait_until = None
            if not self.do_quota_room(ns, csize, evict):
                if evict:  # final: no more room will come for this put
                    self.counters["quota_refused"] += 1
                    if self.on_quota is not None:
                        self.on_quota("refused", ns, 1)
                return PutSlot(Status.NO_SPACE, extra={"quota": True})
            off = self.do_alloc(need, evict)
            if off is None:
                if evict:
                    self.counters["no_space"] += 1
                return PutSlot(Status.NO_SPACE)
            version = self._next_version
            self._next_version += 1
            data_off = self.arena.write_header(off, ns, key, version, total_len,
                                               time.time_ns(), ph)
            o = _Obj(ns, key, off, csize, data_off, total_len, version, ph=ph, parent=parent)
            self.do_charge_ns(ns, o.chunk)
            self.uncommitted_bytes += o.chunk
            if holder is not None:
                self.do_charge(holder, o)  # fits: checked above, under the same lock
            pend = _Pending(o, deadline=self.clock() + self.pending_timeout, expect=csum)
            if sliced:
                pend.key = (ns, key, put_id)
                self._pending[pend.key] = pend
        elif pend.obj.length != total_len or pend.failed or pend.expect != csum:
            return PutSlot(Status.BAD_REQUEST)
        if sliced and not pend.claim(offset, offset + length):
            return PutSlot(Status.BAD_REQUEST)  # empty, or overlaps another slice
        if sliced and holder is not None:
            pend.holders.add(holder)  # its close fails the put if still incomplete
            holder.pendings.add(pend)
        o = pend.obj
        o.pins += 1  # the writer's hold; keeps expiry from freeing it
        view = self.arena.buf[o.data_off + offset:o.data_off + offset + length]
        return PutSlot(Status.OK, view, pend, {"key": (ns, key, put_id), "len": length})

    def do_wait_for_room(self, holder: Holder, chunk: int) -> bool:
        """Back-pressure on a reservation past the per-connection or total bound (caller
        holds the lock): True while ``holder`` may keep waiting, up to ``reserve_wait_s``,
        for reservations in flight to commit or expire; ``begin_put`` then retries with
        the lock released. A client's own batch of sliced puts can briefly hold more than
        the bound while its other connections finish their slices; a hostile holder only
        delays itself, once: after a wait ran out it gets BUSY at once for
        ``reserve_wait_s`` (so a frame of many items waits once, not once per item)."""
        if chunk > min(self.max_held, self.max_reserved):
            return False  # can never fit
        now = time.monotonic()
        if holder.wait_until is None:
            if now < holder.no_wait_until:
                return False
            holder.wait_until = now + self.reserve_wait_s
        if now < holder.wait_until:
            return True
        holder.wait_until = None
        holder.no_wait_until = now + self.reserve_wait_s
        return False

    def finish_put(self, slot: PutSlot, *, if_absent: bool = False,
                   digest: int | None = None) -> Status:
        """Commit the slot's slice; the last slice publishes. ``if_absent`` (on any slice
        of the put): publish only if the key has no current object here or below, checked
        in the same lock hold as the publish (the arena commit flag too, so a skipped put
        never survives a restart); a skipped put answers OK and is counted. ``digest``:
        the caller's xxh3_64 of ``slot.view`` read after its bytes landed (``read_staged``
        hashes as it reads); used only when the slot is the whole value, which is then
        not hashed a second time. Only the server writes a reserved chunk, so the bytes
        cannot change between that hash and the publish."""
        return self.finish_puts([slot], if_absent=if_absent, digests=[digest])[0]

    def finish_puts(self, slots: list[PutSlot], *, if_absent: bool = False,
                    digests: list[int | None] | None = None) -> list[Status]:
        """``finish_put`` of each slot (``digests[i]`` for ``slots[i]``), in order, with
        one lock hold per ``LOCK_BATCH`` slots to count the slices in and one to publish
        them: the same statuses and the same index as one call per slot."""
        if digests is None:
            digests = [None] * len(slots)
        out: list[Status] = [Status.OK] * len(slots)
        wholes = []  # a digest counts only for a slot that is the whole value
        for slot in slots:
            wholes.append(len(slot.view) == slot.token.obj.length)
            slot.view.release()
        ready: list[tuple[int, _Pending, int | None]] = []  # (slot, its put, digest)
        for a in range(0, len(slots), LOCK_BATCH):
            with self._lock:
                for i in range(a, min(a + LOCK_BATCH, len(slots))):
                    slot = slots[i]
                    pend: _Pending = slot.token
                    o = pend.obj
                    o.pins -= 1
                    pend.received += slot.extra["len"]
                    pend.if_absent = pend.if_absent or if_absent
                    if pend.failed:
                        if o.pins == 0 and not o.quarantined:
                            self.do_free(o)
                        out[i] = Status.ERROR
                    elif pend.received >= o.length:  # claims are disjoint: == is all
                        self.do_drop_pending(pend)
                        ready.append((i, pend, digests[i] if wholes[i] else None))
                    # else other slices still to come: OK
        # every byte of each ready put is here: checksum outside the lock, then commit
        publish: list[tuple[_Pending, int]] = []  # (the put, its checksum)
        refused: list[_Obj] = []
        for i, pend, digest in ready:
            o = pend.obj
            csum = (digest if digest is not None
                    else checksum(self.arena.buf[o.data_off:o.data_off + o.length]))
            if pend.expect is not None and csum != pend.expect:
                # not the bytes the writer sent (corrupted in flight, scribbled on, or
                # never written: an ALLOC committed without a write): never published
                out[i] = Status.CORRUPT
                refused.append(o)
                continue
            if not pend.if_absent:
                self.arena.commit(o.offset, csum)
            publish.append((pend, csum))
        if not publish and not refused:
            return out
        over = False
        if refused:
            with self._lock:
                for o in refused:
                    self.counters["put_checksum_mismatch"] += 1
                    if o.pins == 0 and not o.quarantined:
                        self.do_free(o)
        for a in range(0, len(publish), LOCK_BATCH):
            with self._lock:
                over = self.do_publish(publish[a:a + LOCK_BATCH]) or over
        for o in refused:
            log.warning("refused a put whose bytes do not match the writer's checksum",
                        extra={"fields": {"ns": o.ns, "key": o.key, "bytes": o.length}})
        if over:
            self.pressure.set()
        return out

    def do_publish(self, publish: list[tuple[_Pending, int]]) -> bool:
        """Publish each complete put ``(its pending, its checksum)`` in order (an
        if-absent one only if its key is absent here and below, its commit flag then
        written under this same lock hold); True if memory or a namespace is now past
        its high watermark."""
        over = False
        for pend, csum in publish:
            o = pend.obj
            if pend.if_absent:
                k = (o.ns, o.key)
                if k in self._index or (self._exists_below is not None
                                        and self._exists_below(*k)):
                    self.counters["put_if_absent_skipped"] += 1
                    if o.pins == 0 and not o.quarantined:
                        self.do_free(o)
                    continue
                self.arena.commit(o.offset, csum)  # under the lock: the check holds
            o.committed = True
            self.uncommitted_bytes -= o.chunk
            self.do_uncharge(o)
            o.checksum = csum
            old = self.do_link(o)
            if old is not None:
                self.do_unlink(old)
            if self.access_observer is not None:
                self.access_observer.on_put(o.ns, o.key, o.length)
            if self._on_publish is not None:
                self._on_publish(o.ns, o.key, o.version)
            over = over or self.live_bytes > self.high * self.capacity
            limit = self.do_mem_limit(o.ns)
            if limit is not None and self._ns[o.ns] > self.high * limit:
                self._quota_wants.setdefault(o.ns, 0)  # shed to low in the background
                over = True
        return over

    def abort_put(self, slot: PutSlot, quarantine: Holder | None = None) -> None:
        """Fail the put. ``quarantine``: its writer may still be copying into the chunk
        (an expired one-sided slot), so keep the chunk allocated, charged to that holder,
        until ``release_holder(quarantine)``: a late write then lands nowhere that
        matters, and its bytes are never published (the put failed)."""
        pend: _Pending = slot.token
        if slot.view is not None:
            slot.view.release()
        o = pend.obj
        with self._lock:
            o.pins -= 1
            pend.failed = True
            self.do_drop_pending(pend)
            if quarantine is not None and not o.quarantined:
                if o.holder is not quarantine:  # charge it to the writer that may scribble
                    self.do_uncharge(o)
                    o.holder = quarantine
                    quarantine.held += o.chunk
                    self.reserved_bytes += o.chunk
                    self.reserved_by_ns[o.ns] = self.reserved_by_ns.get(o.ns, 0) + o.chunk
                o.quarantined = True
                quarantine.quarantine.append(o)
                self.counters["quarantined"] += 1
                if quarantine.closed:  # closed meanwhile: nothing will release it later
                    self.do_release_quarantine(quarantine)
            elif o.pins == 0 and not o.quarantined:
                self.do_free(o)

    def do_release_quarantine(self, holder: Holder) -> None:
        for o in holder.quarantine:
            o.quarantined = False
            if o.pins == 0:
                self.do_free(o)
        holder.quarantine.clear()

    def release_holder(self, holder: Holder) -> None:
        """The holder's connection closed: fail every incomplete sliced put it contributed
        to (its slices will never be retried there) and free its quarantined chunks."""
        with self._lock:
            holder.closed = True
            for pend in list(holder.pendings):
                self.do_drop_pending(pend)
                if not pend.failed:
                    pend.failed = True
                    self.counters["pending_released"] += 1
                if pend.obj.pins == 0 and not pend.obj.quarantined:
                    self.do_free(pend.obj)
            self.do_release_quarantine(holder)

    # ------------------------------------------------------------------ scratch
    def reserve_scratch(self, nbytes: int, holder: Holder) -> tuple[memoryview, Scratch] | None:
        """An unpublished chunk for ``nbytes`` read from the tier below (a disk hit the
        server leases to a co-located reader, ``shm_ops``): granule-aligned, so
        page-aligned for O_DIRECT; never indexed, never given a header or a start mark
        (recovery and compaction pass over it like a put in flight). Charged to
        ``holder`` within the reservation bounds; never evicts (a read must not push
        cached objects out): None without room. ``(a view of its first nbytes, token)``;
        ``release_scratch(token)`` frees it."""
        csize = size_class(max(nbytes, 1))
        with self._lock:
            if (holder.closed or holder.held + csize > self.max_held
                    or self.reserved_bytes + csize > self.max_reserved):
                self.counters["scratch_refused"] += 1
                return None
            g = self._extents.alloc(csize // GRANULE)
            if g is None:
                self.counters["scratch_refused"] += 1
                return None
            off = self.arena.granule_offset(g)
            self.live_bytes += csize
            holder.held += csize
            self.reserved_bytes += csize
            self.scratch_bytes += csize
            self.counters["scratch_reserved"] += 1
        return self.arena.buf[off:off + nbytes], Scratch(off, csize, holder)

    def release_scratch(self, token: Scratch) -> None:
        """Free a ``reserve_scratch`` chunk; once (a second call does nothing)."""
        with self._lock:
            if token.freed:
                return
            token.freed = True
            self._extents.release(self.arena.granule_of(token.off), token.chunk // GRANULE)
            self.live_bytes -= token.chunk
            token.holder.held -= token.chunk
            self.reserved_bytes -= token.chunk
            self.scratch_bytes -= token.chunk

    # ------------------------------------------------------------------ background
    def _evict_loop(self) -> None:
        while not self._stop.is_set():
            self.pressure.wait(0.2)
            self.pressure.clear()
            self.step()

    def step(self) -> None:
        """One evictor pass: watermarks, stalled sliced puts, and the recency snapshot
        when it is due. Steppable in tests."""
        self.expire_pending()
        self.evict_to_low()
        self.snapshot_recency_if_due()

    def snapshot_recency_if_due(self) -> int:
        """``snapshot_recency`` once ``recency_snapshot_s`` has passed since the last
        (the evictor's ``step``, or the tiered store's mover); 0 when not due."""
        if self.recency_snapshot_s <= 0 or self.clock() < self._next_snapshot:
            return 0
        self._next_snapshot = self.clock() + self.recency_snapshot_s
        return self.snapshot_recency()

    def expire_pending(self) -> None:
        """Reclaim sliced puts that stalled past ``pending_put_timeout_ms``."""
        now = self.clock()
        with self._lock:
            for p in list(self._pending.values()):
                if p.deadline < now:
                    self.do_drop_pending(p)
                    p.failed = True
                    self.counters["pending_expired"] += 1
                    if p.obj.pins == 0 and not p.obj.quarantined:
                        self.do_free(p.obj)

    def evict_to_low(self) -> None:
        """Namespaces past their quota's high watermark first, down to its low one; then,
        above the arena's high watermark, the policy's candidates (to nothing) down to the
        low one."""
        for ns, excess in self.quota_wants():
            self.evict_ns(ns, excess)
        if self.live_bytes <= self.high * self.capacity:
            return
        while True:
            with self._lock:  # evict in small locked batches so IO threads interleave
                for _ in range(64):
                    if self.live_bytes <= self.low * self.capacity or not self.do_evict_one():
                        return

    # ------------------------------------------------------------------ tiering
    def claim_cold(self, max_bytes: int, max_items: int = 4096,
                   ns: bytes | None = None) -> list[ColdObject]:
        """Pin up to ``max_bytes`` of the policy's first candidates (of namespace ``ns``
        only, when given) for demotion; namespaces over their quota go first.

        Each claimed object must go back through ``finish_demotion``. Its bytes stay
        readable (``data_view``) and are never freed while claimed.
        """
        out: list[ColdObject] = []
        total = 0
        with self._lock:
            candidates = self.policy.candidates
            if ns is not None:
                objs = candidates(ns)
            else:
                objs = itertools.chain(*(candidates(n) for n in self._over if n in self._ns),
                                       candidates())
            for o in objs:
                if o.moving:
                    continue
                o.pins += 1
                o.moving = True
                out.append(ColdObject(o.ns, o.key, o.version, o.length, o.checksum, o.chunk, o,
                                      o.ph))
                total += o.chunk
                if total >= max_bytes or len(out) >= max_items:
                    break
        return out

    def data_view(self, cold: ColdObject) -> memoryview:
        """A claimed object's bytes in the arena (the claim pins it; release the view)."""
        o: _Obj = cold.handle
        return self.arena.buf[o.data_off:o.data_off + o.length]

    def finish_demotion(self, cold: ColdObject, publish: Callable[[], bool] | None,
                        corrupt: bool = False) -> bool:
        """Release a claim. If the object is still the current one and ``publish()`` (run
        under the lock: it makes the disk copy visible) returns True, drop it from memory
        and return True. ``corrupt``: its bytes failed their checksum: drop and count it."""
        o: _Obj = cold.handle
        k = (o.ns, o.key)
        with self._lock:
            o.pins -= 1
            o.moving = False
            current = self._index.get(k) is o
            if current and corrupt:
                self.do_unindex(o)
                self.counters["corrupt_dropped"] += 1
                self.do_unlink(o)
            elif current and publish is not None and publish():
                self.do_unindex(o)
                self.do_unlink(o)
                return True
            elif o.pins == 0 and o.doomed:
                self.do_free(o)
        if corrupt:
            log.error("dropped corrupt object (checksum mismatch on its way to disk)",
                      extra={"fields": {"ns": o.ns, "key": o.key, "bytes": o.length}})
        return False

    def admit(self, ns: bytes, key: bytes, data: memoryview, version: int, csum: int,
              still_valid: Callable[[], bool], ph: int | None = None) -> bool:
        """Copy a verified object in under its own ``version`` and placement hash ``ph``
        (promotion from disk).

        Only into free space (never evicts; past the high watermark the mover then
        demotes colder objects). Publishes only if
        the key is still absent from memory and ``still_valid()`` (run under the lock)
        says the source is current; the copy is checksummed against ``csum`` first.
        """
        need = header_len(len(ns), len(key), ph is not None) + len(data)
        csize = size_class(need)
        if csize > self.arena.slab_bytes:
            return False
        with self._lock:
            if (ns, key) in self._index or self.do_over_quota(ns, csize):
                return False  # never promote a namespace past its quota
            off = self.do_alloc(need, evict=False)
            if off is None:
                return False
            over = self.live_bytes > self.high * self.capacity
            data_off = self.arena.write_header(off, ns, key, version, len(data), time.time_ns(),
                                               ph)
            o = _Obj(ns, key, off, csize, data_off, len(data), version, pins=1, ph=ph)
            self.do_charge_ns(ns, csize)
            self.uncommitted_bytes += csize
        dst = self.arena.buf
        for a in range(0, len(data), 256 << 10):  # short GIL holds: serving threads interleave
            b = min(len(data), a + (256 << 10))
            dst[data_off + a:data_off + b] = data[a:b]
        got = checksum(dst[data_off:data_off + len(data)])
        with self._lock:
            o.pins -= 1
            if got != csum or (ns, key) in self._index or not still_valid():
                self.do_free(o)
                return False
            self.arena.commit(off, got)  # under the lock: never a committed orphan
            o.committed = True
            self.uncommitted_bytes -= csize
            o.checksum = got
            self.do_link(o)
        if over:
            self.pressure.set()
        return True

    def versions(self) -> dict[tuple[bytes, bytes], int]:
        with self._lock:
            return {k: o.version for k, o in self._index.items()}

    def delete_if_version(self, ns: bytes, key: bytes, version: int) -> bool:
        """Drop ``key`` if its current object is ``version``: from memory, and below
        (``on_delete_version``, in the same lock hold). True if either dropped it."""
        with self._lock:
            o = self._index.get((ns, key))
            if o is not None and o.version != version:
                return False  # memory holds another (newer) object: nothing below is current
            below = (self._on_delete_version is not None
                     and self._on_delete_version(ns, key, version))
            if o is None:
                return below
            self.do_unindex(o)
            self.do_unlink(o)
            return True

    def held(self) -> Iterator[HeldObject]:
        """The committed objects, a chunked snapshot (``tier.held_snapshot``)."""
        return held_snapshot(self._lock, self._index,
                             lambda k, o: HeldObject(o.ns, o.key, o.length, o.version, o.ph))

    def quota_event(self, event: str, ns: bytes, n: int) -> None:
        """Count a quota event for ``ns`` (the tier below's, e.g. ``disk_evicted``)."""
        if self.on_quota is not None:
            self.on_quota(event, ns, n)

    def next_version(self) -> int:
        """The version the next put will get: every object put from now on has a version
        at least this (a promotion keeps its object's older one). Any thread, no lock."""
        return self._next_version

    def bump_version(self, at_least: int) -> None:
        """Never hand out a version below ``at_least`` (the disk tier's versions)."""
        with self._lock:
            self._next_version = max(self._next_version, at_least)

    # ------------------------------------------------------------------ info
    def stats(self) -> dict[str, int | float]:
        with self._lock:
            return {
                "capacity_bytes": self.capacity,
                "used_bytes": self.live_bytes,
                "objects": len(self._index),
                "pending_puts": len(self._pending),
                "reserved_bytes": self.reserved_bytes,
                "scratch_bytes": self.scratch_bytes,
                "free_pages": self._extents.free * GRANULE // self.arena.slab_bytes,
                "pages": self.arena.npages,
                "free_bytes": self._extents.free * GRANULE,
                "largest_free_bytes": self._extents.largest() * GRANULE,
                **self.counters,
            }

    def namespace_usage(self) -> dict[bytes, tuple[int, int]]:
        """``(chunk bytes, 0)`` per namespace (committed, in flight and reserved)."""
        with self._lock:
            return {ns: (mem, 0) for ns, mem in self._ns.items()}

    def keys(self) -> list[tuple[bytes, bytes]]:
        """The resident keys, in the policy's order (the first to give up first)."""
        with self._lock:
            return [(o.ns, o.key) for o in self.policy.candidates()]

    def close(self, clean: bool = True) -> None:
        self._stop.set()
        self.pressure.set()
        if self._evictor is not None:
            self._evictor.join(timeout=2)
        with self._lock:
            for p in self._pending.values():
                self.arena.clear(p.obj.offset)  # never-committed slices must not survive
            self._pending.clear()
            if clean and not self.arena.mm.closed:
                self.do_save_recency()
            self.arena.close(clean, self._next_version)

    def do_save_recency(self) -> None:
        """Write each object's place in the policy's order into its chunk header, all
        at once (a clean stop), so the next start rebuilds that order (``_recover``)."""
        order = list(self.policy.saved_order())
        base = self.do_take_ranks(len(order))
        self.do_write_ranks(order, base, 0, len(order))
        self.do_record_snapshot(len(order), base)

    def snapshot_recency(self) -> int:
        """Save the policy's order in the arena (``_recover`` rebuilds it after a crash
        too), holding the lock for ``_RANK_BATCH`` objects at a time; returns how many.
        Hottest first: a crash part-way leaves the coldest with an older snapshot's
        (lower) ranks, still before the rest. The evictor or mover thread
        (``snapshot_recency_if_due``), or a test."""
        with self._lock:
            if self.arena.mm.closed:
                return 0
            order = list(self.policy.saved_order())
            base = self.do_take_ranks(len(order))
        for hi in range(len(order), 0, -_RANK_BATCH):
            with self._lock:
                if self.arena.mm.closed:
                    return 0
                self.do_write_ranks(order, base, max(0, hi - _RANK_BATCH), hi)
        with self._lock:
            if not self.arena.mm.closed:
                self.do_record_snapshot(len(order), base)
        return len(order)

    def do_take_ranks(self, n: int) -> int:
        """Reserve ``n`` ranks; the first. They only grow, until the u32 would wrap."""
        base = self._next_rank
        if base + n > RANK_MAX:
            base = 1
        self._next_rank = base + n
        return base

    def do_write_ranks(self, order: list, base: int, lo: int, hi: int) -> None:
        """Rank ``base + i`` for ``order[i]``, ``lo <= i < hi``, if still current (an
        object that left may have lent its chunk to another)."""
        get, set_rank = self._index.get, self.arena.set_rank
        for i, o in enumerate(order[lo:hi], base + lo):
            if get((o.ns, o.key)) is o:
                set_rank(o.offset, i)

    def do_record_snapshot(self, n: int, base: int) -> None:
        seq = self.arena.snapshot_record()[0] + 1
        self.arena.write_snapshot_record(seq, time.time_ns(), n, base + n)


__all__ = ["MemoryTier", "HDR_FIXED"]
