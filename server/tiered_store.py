"""TieredStore: the memory tier in front of the NVMe tier, behind the one Tier contract.

Design. The service talks to one ``Tier``; with ``--disk-dir`` that is this
store. Memory stays the front: every put lands in memory, reads try memory
first and fall back to disk. One background thread, the mover, does all disk
writes:

* Demotion. Above the memory high watermark the mover claims the coldest
  objects (the eviction policy's first candidates; pinned, so their bytes stay
  put), copies them into the segment log's write buffer — checking each
  against its checksum on the way — flushes
  with one large pwrite, then publishes each disk copy and drops the memory
  copy in one step under memory lock -> disk lock. A reader therefore always
  finds the object in one of the two. An object that changed meanwhile
  (replaced, deleted) is not dropped and its new disk record dies at once. An
  object that already has an identical disk copy (it was promoted and not
  changed since) is dropped without a write. Only with the disk degraded (or
  full beyond compaction) does memory evict to nothing; a put that finds
  memory full waits up to ``room_wait_s`` for the mover before that happens.
* Reads. A GET frame's items are pinned together (``pin_read_many``): memory
  hits at once, disk hits read and verified in parallel on ``io_threads``
  threads (plus the caller), so one frame keeps the device busy at a queue
  depth above one and checksums overlap other reads. Each thread claims a group
  of up to ``_GROUP_ITEMS`` items and reads it with one ``DiskSide.read_many``
  (one native call, the GIL released once for the group's reads and checksums). A streamed reply
  (``pin_read_stream``) gets the verified prefix as it grows: the caller sends
  it while the IO threads read on (at least ``_STREAM_MIN_BYTES`` at a time
  while it has reads of its own to claim), else reads an item itself. A caller whose send fails marks the frame aborted (the IO
  threads skip what is left), waits out the reads in progress, then unpins.
* Promotion. A disk hit is served from a buffer verified against the
  record's checksums. After the reply is sent (``unpin``), the promote policy
  (``tiering``) may copy the verified bytes into memory under the object's
  own version (so a sliced read in flight sees no conflict); hits that read
  only part of an object are queued and the mover re-reads them whole. The
  disk copy stays as a clean backing copy.
* One authoritative copy per key. Versions come from the memory tier and are
  never reused (it starts above the disk's highest version). A put kills older
  disk copies and a delete removes both, atomically with the memory index
  change (the memory tier's hooks run under its lock); deaths are persisted,
  so a restart cannot resurrect them. Promotion publishes only if the disk
  copy is still current and memory has no newer object.
* Quotas (``gcache.quotas``). A put that finds its namespace at its memory quota
  waits up to ``room_wait_s`` for the mover to demote that namespace's own coldest
  objects, then evicts them (never another namespace's). A namespace past the
  high watermark of its quota is demoted down to the low one in the background.
  On disk, a demotion that would take its namespace past ``disk_bytes`` first
  kills that namespace's oldest disk records (``DiskSide.fit_quota``);
  segments are shared, so their space comes back with compaction, but the
  namespace's live bytes never exceed its quota and nobody else's records go.
  An object that cannot fit the namespace's disk quota at all is dropped.
* Compaction and recovery from a degraded disk also run on the mover, so the
  segment log has one writer. ``touch`` refreshes recency on the tier that
  holds the object.

Written only against ``movement`` (``MemorySide``, ``DiskSide`` and the records
crossing between them); it holds neither tier's lock itself.

Threads: ``Tier`` methods from connection threads; ``step`` from the mover
(or a test). Lock order (``movement.LockRank``): memory tier lock, then segment
log lock; the memory tier's hooks and callbacks are the only place both are held.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
import itertools
import queue
from typing import Any, Callable, Iterator

from gcache.server.movement import (ColdObject, DemoteItem, DiskSide, MemorySide, ReadLease,
                                    ScratchSource, disk_hooks)
from gcache.server.tier import HeldObject, Pinned, PutRequest, PutSlot, Tier
from gcache.server.tiering import CompactionPolicy, PromotePolicy, SecondChance
from gcache.status import Status

log = logging.getLogger("gcache.server.tiering")

_PROMOTE_QUEUE = 1024
_COMPACTIONS_PER_BATCH = 4
# a streamed reply sends less than this while it still has reads of its own to claim:
# every reply frame costs a header and syscalls on both sides (measured: one frame per
# 64 KiB item cost ~20 us of CPU per item, server and client together)
_STREAM_MIN_BYTES = 256 << 10
# a frame's disk reads are claimed in groups of up to this many items (fewer when the
# frame has fewer items than IO threads + the caller): each group is one
# ``DiskSide.read_many``, its reads issued and checksummed with the GIL released once,
# not once per item. Measured in-process (bench/disk_read_path.py: 16-item frames, 4
# callers, 6 alternated rounds): CPU per 64 KiB item, median 68 -> 57 us; groups of 8
# items made a lone 64-item frame slower (fewer reads in flight) (bench/RESULTS.md,
# issue 13 fifth pass)
_GROUP_ITEMS = 4


class _Frame:
    """One GET frame's disk reads, claimed group by group (``groups``: lists of item
    indices, each read in one ``DiskSide.read_many``) by the caller and IO threads.
    ``finished[i]`` is set (under ``progress``) once ``out[i]`` is final; a streaming
    caller waits on ``progress`` for the next item in order."""

    __slots__ = ("ns", "items", "out", "groups", "claim", "left", "progress", "done",
                 "failed", "finished", "aborted", "want", "dest")

    def __init__(self, ns: bytes, items: list, out: list[Pinned],
                 groups: list[list[int]], dest: ScratchSource | None = None) -> None:
        self.ns, self.items, self.out, self.groups = ns, items, out, groups
        self.dest = dest  # read into these buffers (``read_disk_into``), not pooled ones
        self.claim = itertools.count()  # next() is atomic under the GIL
        self.left = len(groups)
        self.progress = threading.Condition(threading.Lock())
        self.done = threading.Event()
        self.failed: BaseException | None = None
        self.finished = bytearray(len(out))  # 1: out[i] is final (memory items at once)
        for i, p in enumerate(out):
            if p.status != Status.MISS:
                self.finished[i] = 1
        self.aborted = False  # the caller gave up (its send failed): claim, skip the read
        self.want = -1  # the item a streaming caller waits for (set under ``progress``)


class TieredStore(Tier):
    def __init__(self, memory: MemorySide, disk: DiskSide, promote: PromotePolicy, *,
                 clock: Callable[[], float] = time.monotonic, room_wait_s: float = 0.5,
                 probe_interval_s: float = 1.0, io_threads: int = 8,
                 compaction: CompactionPolicy | None = None) -> None:
        """``promote``: when a disk hit goes back to memory; ``compaction``: which
        segment compaction reclaims and which records it carries (default
        ``SecondChance``). Both from ``tiering``."""
        self.memory, self.disk, self.promote = memory, disk, promote
        self.compaction = compaction if compaction is not None else SecondChance()
        self.clock = clock
        self.room_wait = room_wait_s
        self.probe_interval = probe_interval_s
        self.capacity = memory.capacity
        self.max_object = memory.max_object
        self.counters = {"demoted": 0, "demoted_bytes": 0, "promoted": 0, "promoted_bytes": 0,
                         "promote_skipped": 0, "demote_batches": 0,
                         "disk_quota_evictions": 0}
        self._stats_lock = threading.Lock()
        self._room = threading.Condition()
        self._queue: deque[tuple[bytes, bytes, int]] = deque()
        self._queued: set[tuple[bytes, bytes]] = set()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._demoting = False
        self._want_room = 0  # bytes a waiting put needs (slab classes fragment memory)
        self._no_wait_until = 0.0
        self._next_probe = 0.0
        self._io_q: queue.SimpleQueue[_Frame | None] = queue.SimpleQueue()
        self._io_threads = [threading.Thread(target=self._io_loop, name=f"gcache-diskio-{i}",
                                             daemon=True) for i in range(io_threads)]
        for t in self._io_threads:
            t.start()
        memory.attach(disk_hooks(disk))  # one authoritative copy per key, atomically
        self.quotas = memory.quotas
        self._disk_quota_gen = -1
        self.recovery = self._reconcile()

    # ------------------------------------------------------------------ startup
    def _reconcile(self) -> dict:
        """After both tiers recovered: one version per key, versions never reused."""
        killed, stale_mem = self.disk.supersede(self.memory.versions())
        for ns, key, v in stale_mem:
            self.memory.delete_if_version(ns, key, v)  # the disk's newer copy stays
        self.memory.bump_version(self.disk.max_version + 1)
        return {"disk_superseded": killed, "memory_superseded": len(stale_mem)}

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="gcache-mover", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ reads
    def pin_read(self, ns: bytes, key: bytes, offset: int, max_len: int,
                 expect_version: int) -> Pinned:
        p = self.memory.pin_read(ns, key, offset, max_len, expect_version)
        if p.status != Status.MISS:
            return p
        return self.disk.read(ns, key, offset, max_len, expect_version)

    def pin_read_many(self, ns: bytes, items: list[tuple[bytes, int, int, int]]
                      ) -> list[Pinned]:
        """Memory hits at once; disk hits read in parallel: the caller claims and reads
        items itself while idle IO threads claim the rest (no per-item futures)."""
        return self._pin_frame(ns, items, None)

    def pin_read_stream(self, ns: bytes, items: list[tuple[bytes, int, int, int]],
                        ready: Callable[[int, list[Pinned]], None]) -> list[Pinned]:
        """``pin_read_many``, the verified prefix handed to ``ready`` as it grows: the
        caller sends what is ready, else reads an unclaimed item, else waits for the
        next one in order (the IO threads keep reading meanwhile)."""
        return self._pin_frame(ns, items, ready)

    def read_disk_into(self, ns: bytes, items: list[tuple[bytes, int, int, int]],
                       holder: Any, ready: Callable[[int, list[Pinned]], None] | None = None,
                       min_bytes: int = _STREAM_MIN_BYTES) -> list[Pinned]:
        """Disk reads of whole records into arena scratch chunks charged to ``holder``
        (``MemorySide.reserve_scratch``), in parallel as a GET frame's: the shm
        transport leases them out (``shm_ops``), so a co-located reader copies a disk
        hit straight from the arena. An OK pin's ``token.scratch`` is ``(its chunk, the
        view's offset in it)``; ``unpin`` frees the chunk. No room, or an item not read
        whole: BUSY, unread. Nothing here looks in memory (the caller just did).

        ``ready(start, pins)``: called as the verified prefix grows (at least
        ``min_bytes`` at a time while reads are left to claim), with the pins of items
        ``[start, start + len(pins))``. Those pins are then the caller's, even if
        ``ready`` raises: it leases or unpins each, and their slots in the returned
        list hold token-less copies (status and sizes only)."""
        taken: list[Any] = []
        handed: set[int] = set()  # scratch chunks whose pins went to ``ready``
        sent = 0

        def dest(n: int) -> tuple[memoryview, Any] | None:
            got = self.memory.reserve_scratch(n, holder)
            if got is not None:
                taken.append(got[1])  # list.append: atomic across the IO threads
            return got

        def hand(end: int, out: list[Pinned]) -> None:
            nonlocal sent
            start, pins = sent, out[sent:end]
            for j in range(start, end):  # items [start, end) are final: no IO thread writes
                p = out[j]
                if p.token is not None:
                    if p.token.scratch is not None:
                        handed.add(id(p.token.scratch[0]))
                    out[j] = Pinned(p.status, p.total_len, p.version, checksum=p.checksum)
            sent = end
            assert ready is not None
            ready(start, pins)

        try:
            out = self._pin_frame(ns, items, None if ready is None else hand, dest, min_bytes)
        except BaseException:
            # _pin_frame unpinned what it still held and ``ready`` owns what it was
            # handed; every other chunk goes here
            for t in taken:
                if id(t) not in handed:
                    self.memory.release_scratch(t)
            raise
        kept = {id(p.token.scratch[0]) for p in out
                if isinstance(p.token, ReadLease) and p.token.scratch is not None} | handed
        for t in taken:  # reserved for reads that failed or were dropped
            if id(t) not in kept:
                self.memory.release_scratch(t)
        return out

    def _pin_frame(self, ns: bytes, items: list[tuple[bytes, int, int, int]],
                   ready: Callable[[int, list[Pinned]], None] | None,
                   dest: ScratchSource | None = None,
                   min_bytes: int = _STREAM_MIN_BYTES) -> list[Pinned]:
        out = (self.memory.pin_read_many(ns, items) if dest is None
               else [Pinned(Status.MISS) for _ in items])
        todo = [i for i, p in enumerate(out) if p.status == Status.MISS]
        if not todo:
            if ready is not None and out:
                try:
                    ready(len(out), out)
                except BaseException:
                    self.memory.unpin_many(out)
                    raise
            return out
        size = max(1, min(_GROUP_ITEMS, -(-len(todo) // (len(self._io_threads) + 1))))
        frame = _Frame(ns, items, out, [todo[a:a + size] for a in range(0, len(todo), size)],
                       dest)
        for _ in range(min(len(frame.groups) - 1, len(self._io_threads))):
            self._io_q.put(frame)
        try:
            if ready is not None:
                self._stream(frame, ready, min_bytes)
        except BaseException:
            self._settle(frame, abort=True)  # the IO threads skip what is left
            self.unpin_many([p for p in out if p.token is not None])
            raise
        self._settle(frame, abort=frame.failed is not None)
        if frame.failed is not None:  # never leak a pin: release what was pinned, then raise
            self.unpin_many([p for p in out if p.token is not None])
            raise frame.failed
        return out

    def _settle(self, frame: _Frame, abort: bool) -> None:
        """Read (or with ``abort``, skip) what is unclaimed, then wait out the reads the IO
        threads claimed: afterwards no thread touches ``frame.out``."""
        frame.aborted = frame.aborted or abort
        while self._read_one(frame):
            pass
        frame.done.wait()

    def _stream(self, frame: _Frame, ready: Callable[[int, list[Pinned]], None],
                min_bytes: int) -> None:
        finished, n, sent = frame.finished, len(frame.out), 0
        while sent < n and frame.failed is None:
            end = sent
            while end < n and finished[end]:
                end += 1
            if end > sent:
                if end < n and self._ready_bytes(frame.out, sent, end) < min_bytes \
                        and self._read_one(frame):
                    continue  # too little to send yet: read one more item meanwhile
                ready(end, frame.out)
                sent = end
            elif not self._read_one(frame):  # nothing left to claim: wait for item `sent`
                with frame.progress:
                    frame.want = sent
                    while not finished[sent]:
                        frame.progress.wait()

    @staticmethod
    def _ready_bytes(out: list[Pinned], start: int, end: int) -> int:
        return sum(len(p.view) for p in out[start:end] if p.view is not None)

    def _read_one(self, frame: _Frame) -> bool:
        """Claim and read one group of ``frame``; False when none is left to claim."""
        j = next(frame.claim)
        if j >= len(frame.groups):
            return False
        group = frame.groups[j]
        try:
            if not frame.aborted:
                items = frame.items
                for i, p in zip(group, self.disk.read_many(frame.ns, [items[i] for i in group],
                                                           frame.dest)):
                    frame.out[i] = p
        except BaseException as exc:  # noqa: B036 - handed to the caller, who raises it
            frame.failed = frame.failed or exc
        with frame.progress:
            for i in group:
                frame.finished[i] = 1
            frame.left -= 1
            if frame.left == 0:
                frame.done.set()
            if frame.want in group:  # the only item a streaming caller waits for
                frame.progress.notify()
        return True

    def _io_loop(self) -> None:
        while (frame := self._io_q.get()) is not None:
            while self._read_one(frame):
                pass

    def unpin(self, pinned: Pinned) -> None:
        lease = pinned.token
        if not isinstance(lease, ReadLease):
            self.memory.unpin(pinned)
            return
        if pinned.view is not None:
            pinned.view.release()
            pinned.view = None
        try:
            if lease.first and self.promote.on_hit(lease.ns, lease.key):
                if lease.whole is not None:
                    self._admit(lease.ns, lease.key, lease.whole, lease.version, lease.checksum,
                                lease.ph)
                else:
                    self._enqueue(lease.ns, lease.key, lease.version)
        finally:
            self.disk.release(lease)
            if lease.scratch is not None:  # read_disk_into's chunk, views released above
                self.memory.release_scratch(lease.scratch[0])

    def unpin_many(self, pins: list[Pinned]) -> None:
        """Memory leases with one memory lock hold; disk leases one by one (``unpin``:
        each may promote)."""
        mem = []
        for p in pins:
            if isinstance(p.token, ReadLease):
                self.unpin(p)
            else:
                mem.append(p)
        self.memory.unpin_many(mem)

    def _admit(self, ns: bytes, key: bytes, data: memoryview, version: int, csum: int,
               ph: int | None) -> bool:
        ok = self.memory.admit(ns, key, data, version, csum,
                               still_valid=lambda: self.disk.has(ns, key, version), ph=ph)
        with self._stats_lock:
            if ok:
                self.counters["promoted"] += 1
                self.counters["promoted_bytes"] += len(data)
            else:
                self.counters["promote_skipped"] += 1
        return ok

    def _enqueue(self, ns: bytes, key: bytes, version: int) -> None:
        with self._stats_lock:
            if (ns, key) in self._queued or len(self._queue) >= _PROMOTE_QUEUE:
                return
            self._queued.add((ns, key))
            self._queue.append((ns, key, version))
        self.memory.pressure.set()

    def exists(self, ns: bytes, key: bytes) -> bool:
        return self.memory.exists(ns, key) or self.disk.exists(ns, key)

    def touch(self, ns: bytes, key: bytes) -> bool:
        return self.memory.touch(ns, key) or self.disk.touch(ns, key)

    def delete(self, ns: bytes, key: bytes) -> bool:
        return self.memory.delete(ns, key)  # on_delete removes the disk copy in the same step

    def delete_if_version(self, ns: bytes, key: bytes, version: int) -> bool:
        return self.memory.delete_if_version(ns, key, version)  # and below, one step

    def held(self) -> Iterator[HeldObject]:
        """Memory's objects, then the disk's not seen in memory: walked in that order, an
        object demoted or promoted meanwhile is still seen (at least) once."""
        seen = set()
        for h in self.memory.held():
            seen.add((h.ns, h.key))
            yield h
        for h in self.disk.held():
            if (h.ns, h.key) not in seen:
                yield h

    # ------------------------------------------------------------------ writes
    def begin_put(self, ns: bytes, key: bytes, total_len: int, offset: int, length: int,
                  put_id: int, *, csum: int | None = None, holder: Any = None,
                  ph: int | None = None, parent: bytes | None = None) -> PutSlot:
        """Memory full: wait up to ``room_wait_s`` for the mover to demote, and only then
        let memory evict to nothing (a bounded backpressure, never a hang). ``ph``: kept
        with the object (``Tier``), in memory and on disk; ``parent``: in memory only."""
        mem = self.memory
        slot = mem.begin_put(ns, key, total_len, offset, length, put_id, evict=False,
                             csum=csum, holder=holder, ph=ph, parent=parent)
        if slot.status != Status.NO_SPACE:
            return slot
        need = mem.object_bytes(ns, key, total_len)
        now = time.monotonic()
        if slot.extra.get("quota"):  # its own namespace is full: demote (or evict) its own
            if not self.disk.degraded and now >= self._no_wait_until:
                end = now + self.room_wait
                while time.monotonic() < end and not self.disk.degraded:
                    mem.want_quota_room(ns, need)
                    with self._room:
                        self._room.wait(min(max(0.0, end - time.monotonic()), 0.05))
                    slot = mem.begin_put(ns, key, total_len, offset, length, put_id,
                                         evict=False, csum=csum, holder=holder, ph=ph,
                                         parent=parent)
                    if slot.status != Status.NO_SPACE:
                        return slot
                    if not slot.extra.get("quota"):
                        break  # within quota now, but the arena is full: wait below
                else:
                    return mem.begin_put(ns, key, total_len, offset, length, put_id,
                                         csum=csum, holder=holder, ph=ph, parent=parent)
            else:
                return mem.begin_put(ns, key, total_len, offset, length, put_id,
                                     csum=csum, holder=holder, ph=ph, parent=parent)
        # waiting only helps if the mover can free something: not with the disk degraded,
        # not when memory is all puts in flight, not right after a wait ran out
        if (not self.disk.degraded and now >= self._no_wait_until
                and mem.live_bytes - mem.uncommitted_bytes >= need):
            end = now + self.room_wait
            while time.monotonic() < end and not self.disk.degraded:
                self._wait_for_room(need, end)
                slot = mem.begin_put(ns, key, total_len, offset, length, put_id,
                                     evict=False, csum=csum, holder=holder, ph=ph,
                                     parent=parent)
                if slot.status != Status.NO_SPACE:
                    return slot
            self._no_wait_until = time.monotonic() + 1.0  # behind: evict for a while
        return mem.begin_put(ns, key, total_len, offset, length, put_id, csum=csum,
                             holder=holder, ph=ph, parent=parent)

    def begin_puts(self, ns: bytes, reqs: list[PutRequest]) -> list[PutSlot]:
        """``begin_put`` of each request, in order: memory reserves as many as it has
        room for in one lock hold, and the rest, from the first NO_SPACE (or the first
        that waits for reservation room), go one by one through ``begin_put`` (which
        waits for the mover)."""
        return self.begin_rest(ns, reqs, self.memory.begin_prefix(ns, reqs, evict=False))

    def _wait_for_room(self, need: int, end: float) -> None:
        with self._room:
            while not self.memory.has_room(need) and not self.disk.degraded:
                left = end - time.monotonic()
                if left <= 0:
                    break
                # announce every round: another put may have taken the room the mover made
                self._want_room = max(self._want_room, need)
                self.memory.pressure.set()
                self._room.wait(min(left, 0.05))

    def finish_put(self, slot: PutSlot, *, if_absent: bool = False,
                   digest: int | None = None) -> Status:
        # on_publish kills older disk copies; if_absent consults the disk's index (exists)
        return self.memory.finish_put(slot, if_absent=if_absent, digest=digest)

    def finish_puts(self, slots: list[PutSlot], *, if_absent: bool = False,
                    digests: list[int | None] | None = None) -> list[Status]:
        return self.memory.finish_puts(slots, if_absent=if_absent, digests=digests)

    def abort_put(self, slot: PutSlot, quarantine: Any = None) -> None:
        self.memory.abort_put(slot, quarantine)

    def release_holder(self, holder: Any) -> None:
        self.memory.release_holder(holder)

    # ------------------------------------------------------------------ the mover
    def _run(self) -> None:
        while not self._stop.is_set():
            self.memory.pressure.wait(0.1)
            self.memory.pressure.clear()
            try:
                self.step()
            except Exception:  # the mover must survive anything; the tier degrades instead
                log.exception("tiering mover step failed")
                time.sleep(0.1)

    def step(self) -> None:
        """One mover pass: expire stalled puts, save memory's eviction order when due,
        recover the disk, promote, demote."""
        mem, disk = self.memory, self.disk
        mem.expire_pending()
        mem.snapshot_recency_if_due()
        if disk.degraded and self._next_probe == 0.0:  # newly degraded: probe a bit later
            self._next_probe = self.clock() + self.probe_interval
        elif disk.degraded and self.clock() >= self._next_probe:
            self._next_probe = self.clock() + self.probe_interval
            if disk.probe():
                self._next_probe = 0.0
        if disk.degraded:
            mem.evict_to_low()  # memory-only: evict to nothing
            self._notify_room()
            return
        self._promote_queued()
        self._enforce_disk_quotas()
        for ns, excess in mem.quota_wants():  # namespaces past their memory quota
            while excess > 0 and not self._stop.is_set():
                moved = self._demote_batch(excess, ns)
                if not moved:  # nothing demotable (disk degraded or full): evict its own
                    mem.evict_ns(ns, excess)
                    break
                excess -= moved
            self._notify_room()
        high, low = mem.high * mem.capacity, mem.low * mem.capacity
        if mem.live_bytes > high or self._want_room:
            self._demoting = True
        while self._demoting and not self._stop.is_set():
            want = self._want_room  # a waiting put's size: its slab class must get room
            if mem.live_bytes <= low and (not want or mem.has_room(want)):
                self._demoting = False
                self._want_room = 0
                break
            for _ in range(_COMPACTIONS_PER_BATCH):
                if not disk.needs_compaction() or disk.degraded:
                    break
                disk.compact_one(self.compaction)
            moved = self._demote_batch(max(int(mem.live_bytes - low), want))
            self._notify_room()
            mem.expire_pending()  # a long demotion run must not keep stalled puts alive
            if not moved:  # disk degraded or full beyond compaction: fall back to eviction
                mem.evict_to_low()
                self._demoting = False
                self._want_room = 0
                self._notify_room()
                break

    def _notify_room(self) -> None:
        with self._room:
            self._room.notify_all()

    def _enforce_disk_quotas(self) -> None:
        """After a quota reload: namespaces past their (new) disk quota shed their oldest
        records."""
        if self.quotas is None or self.quotas.generation == self._disk_quota_gen:
            return
        self._disk_quota_gen = self.quotas.generation
        for ns in self.disk.namespace_bytes():
            limit = self.quotas.limits(ns).disk_bytes
            if limit is not None:
                self._count_quota_eviction(ns, self.disk.fit_quota(ns, limit, 0)[0])

    def _count_quota_eviction(self, ns: bytes, n: int = 1) -> None:
        if not n:
            return
        with self._stats_lock:
            self.counters["disk_quota_evictions"] += n
        self.memory.quota_event("disk_evicted", ns, n)

    def _fit_disk_quotas(self, dirty: list[ColdObject]
                         ) -> tuple[list[ColdObject], list[ColdObject]]:
        """Split objects headed for disk into those that fit their namespace's disk quota
        (after killing that namespace's oldest records) and those that do not (dropped).
        The warmest objects are placed first, so the coldest are the ones dropped."""
        if self.quotas is None or not self.quotas.active:
            return dirty, []
        fit, drop = [], []
        planned: dict[bytes, int] = {}
        for o in reversed(dirty):  # claimed coldest first
            limit = self.quotas.limits(o.ns).disk_bytes
            if limit is None:
                fit.append(o)
                continue
            want = planned.get(o.ns, 0) + self.disk.record_bytes(o.ns, o.key, o.length,
                                                                 o.ph is not None)
            killed, fits = self.disk.fit_quota(o.ns, limit, want)
            self._count_quota_eviction(o.ns, killed)
            if fits:
                planned[o.ns] = want
                fit.append(o)
            else:
                drop.append(o)
        fit.reverse()
        return fit, drop

    def _demote_batch(self, excess: int, ns: bytes | None = None) -> int:
        """Demote up to ``excess`` bytes (of ``ns`` only, when given); returns the bytes
        taken out of memory."""
        mem, disk = self.memory, self.disk
        budget = max(1, min(excess, disk.max_record * 2, 16 << 20))
        objs = mem.claim_cold(budget, ns=ns)
        if not objs:
            return 0
        clean, dirty = [], []
        for o in objs:
            (clean if disk.has(o.ns, o.key, o.version) else dirty).append(o)
        dirty, over = self._fit_disk_quotas(dirty)
        freed = 0
        for o in over:  # no room within its namespace's disk quota: dropped from memory
            if mem.finish_demotion(o, lambda: True):
                freed += o.chunk
                self._count_quota_eviction(o.ns)
        views = [mem.data_view(o) for o in dirty]
        try:
            res = disk.append([DemoteItem(o.ns, o.key, o.version, v, o.checksum, ph=o.ph)
                               for o, v in zip(dirty, views)])
        finally:
            for v in views:
                v.release()
        moved = moved_bytes = 0
        for o in clean:
            if mem.finish_demotion(o, lambda o=o: disk.has(o.ns, o.key, o.version)):
                moved += 1
                moved_bytes += o.length
                freed += o.chunk
        for o, r in zip(dirty, res):
            if isinstance(r, Status):  # never written
                mem.finish_demotion(o, None, corrupt=r == Status.CORRUPT)
            elif mem.finish_demotion(o, lambda o=o, r=r: disk.publish(o.ns, o.key, r)):
                moved += 1
                moved_bytes += o.length
                freed += o.chunk
            else:
                disk.discard(o.ns, o.key, r)  # changed meanwhile
        with self._stats_lock:
            self.counters["demoted"] += moved
            self.counters["demoted_bytes"] += moved_bytes
            self.counters["demote_batches"] += 1
        return freed

    def _promote_queued(self) -> None:
        while True:
            with self._stats_lock:
                if not self._queue:
                    return
                ns, key, version = self._queue.popleft()
                self._queued.discard((ns, key))
            p = self.disk.read_whole(ns, key, version)
            try:
                if p.status == Status.OK:
                    self._admit(ns, key, p.token.whole, version, p.token.checksum, p.token.ph)
            finally:
                if p.view is not None:
                    p.view.release()
                if isinstance(p.token, ReadLease):
                    self.disk.release(p.token)

    # ------------------------------------------------------------------ info / shutdown
    def stats(self) -> dict[str, int | float]:
        s = self.memory.stats()
        s.update(self.disk.stats())
        with self._stats_lock:
            s.update(self.counters)
        return s

    def namespace_usage(self) -> dict[bytes, tuple[int, int]]:
        """``(memory bytes, disk bytes)`` per namespace."""
        mem = self.memory.namespace_usage()
        disk = self.disk.namespace_bytes()
        return {ns: (mem.get(ns, (0, 0))[0], disk.get(ns, 0))
                for ns in mem.keys() | disk.keys()}

    def close(self, clean: bool = True) -> None:
        self._stop.set()
        self.memory.pressure.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        for _ in self._io_threads:
            self._io_q.put(None)
        for t in self._io_threads:
            t.join(timeout=5)
        with self._room:
            self._room.notify_all()
        self.disk.close(clean)
        self.memory.close(clean)
