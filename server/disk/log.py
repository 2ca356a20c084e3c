"""The NVMe tier's mechanism: ``SegmentLog``, a log-structured store of checksummed
records (their format: ``records``; restart: ``recovery``).

Design. The disk tier is an append-only log cut into fixed-size segment files
(``segment_bytes``, default 64 MiB) under ``{disk_dir}/gcache-{name}/``. The
one writer (the tiering mover thread) packs records into an aligned write
buffer and flushes it with one large ``pwrite``; readers (connection threads)
``preadv`` a record into a pooled page-aligned buffer and verify it before a
single byte is served. Space comes back one segment at a time: compaction
reclaims the sealed segment its policy picks (``tiering.CompactionPolicy``;
by default the one with the fewest live bytes), carries its hot records (read
or touched since written) to the head of the log, drops the cold ones, and
deletes the file.

Faults are values. A failed write or segment allocation (EIO, ENOSPC)
degrades the tier: no more writes, reads keep working, ``degraded`` says why
and the mover's ``probe`` retries until space or the device is back. A read
that fails its checksum drops the record, counts it and answers CORRUPT.

Eviction policy (optional, ``eviction_policy=``; the server passes the one
``--eviction-policy`` names). The log then tells an ``eviction.EvictionPolicy`` of its own
about every live record (``_DiskObj``: ``chunk`` is the record's bytes): linked,
unlinked, read (a hit) or touched, all with ``self.lock`` held. Compaction with an
order-aware ``CompactionPolicy`` (``tiering.PolicyOrder``, the server's) marks the
records the policy gives up first, one segment's worth of sealed bytes
(``do_cold_set``), reclaims the segment that leaves the fewest other live bytes to
carry, drops its marked records and carries the rest (``do_carry``: they keep their place in
the policy's order). A quota eviction kills the namespace's first candidate instead of its
oldest record.

Placement hashes (``tier`` docstring). A ``DemoteItem``'s ``ph`` goes into its record
(``records.FLAG_PLACED``) and the index entry (``Entry.ph``, also in the index file);
compaction carries it, reads hand it to promotion (``ReadLease.ph``) and ``held``
yields it.

Namespaces. The tier keeps each namespace's live record bytes and its keys in
write order (``_NsDisk``; rebuilt at start in (segment, offset) order, which is
write order), so a per-namespace disk quota can kill that namespace's oldest
records (``fit_quota``) without touching anyone else's. Segments are shared: a
killed record's space comes back when compaction reclaims its segment.

Threads: this is the disk side of ``movement`` (``DiskSide``), which says, per
method, which thread calls it and whether it blocks. In short:
``read``/``touch``/``delete``/``exists`` from any thread;
``append``/``compact_one``/``probe``/``close`` from the one mover thread.
``self.lock`` (``LockRank.DISK``) guards the index and segment table; it may be
taken while the memory tier's lock is held (order: memory -> disk), never the
other way. ``do_`` methods require the caller to hold ``self.lock``; only this
module (and its tests) call them.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import mmap
import os
import struct
import threading
import time
from typing import TYPE_CHECKING, Any, Iterator, Mapping

from gcache import native
from gcache.errors import DiskError
from gcache.failpoints import failpoint, os_error
from gcache.hashing import checksum
from gcache.server.eviction import EvictionPolicy
from gcache.server.disk.recovery import (ScanMerge, decode_index, encode_index,
                                         take_index_file, write_index_file)
from gcache.server.disk.records import (BLOCK, DEAD, Entry, align, build_record,
                                        check_fields, pack_death, pack_segment_header,
                                        parse_deaths, parse_header, pread_into, pwrite_all,
                                        read_segment_header, record_geometry, segment_paths,
                                        sums_offset,
                                        tier_root, ZEROS)
from gcache.server.movement import DemoteItem, LockRank, ReadLease, ScratchSource, ranked_lock
from gcache.server.tier import HeldObject, Pinned, held_snapshot
from gcache.server.tiering import CompactionPolicy, SealedSegment, SecondChance
from gcache.status import Status

if TYPE_CHECKING:
    from gcache.server.kv_events import EventQueue

log = logging.getLogger("gcache.server.disk")

_SECOND_CHANCE = SecondChance()


class _NsDisk:
    """One namespace on disk: live record bytes and its keys, oldest first."""

    __slots__ = ("bytes", "keys")

    def __init__(self) -> None:
        self.bytes = 0
        self.keys: dict[bytes, None] = {}


class _DiskObj:
    """A live record as the eviction policy sees it (``eviction.Resident``); hashes by
    identity."""

    __slots__ = ("ns", "key", "e")
    parent = None  # chain parents are not kept on disk: unknown

    def __init__(self, ns: bytes, key: bytes, e: Entry) -> None:
        self.ns, self.key, self.e = ns, key, e

    @property
    def length(self) -> int:
        return self.e.length

    @property
    def chunk(self) -> int:
        return self.e.rec_len

    @property
    def version(self) -> int:
        return self.e.version


class Segment:
    __slots__ = ("id", "path", "dead_path", "fd", "dead_fd", "salt", "write_off", "sealed",
                 "live_bytes", "keys", "readers", "retired", "dead_next", "created_ns")

    def __init__(self, seg_id: int, path: str, fd: int, dead_fd: int, salt: int,
                 write_off: int, created_ns: int) -> None:
        self.id, self.path, self.fd, self.dead_fd, self.salt = seg_id, path, fd, dead_fd, salt
        self.dead_path = path[:-4] + ".dead"
        self.write_off = write_off
        self.sealed = False
        self.live_bytes = 0
        self.keys: set[tuple[bytes, bytes]] = set()
        self.readers = 0
        self.retired = False
        self.dead_next = 0
        self.created_ns = created_ns

    def close(self) -> None:
        for fd in (self.fd, self.dead_fd):
            if fd >= 0:
                try:
                    os.close(fd)
                except OSError:
                    pass
        self.fd = self.dead_fd = -1


class BufferPool:
    """Page-aligned buffers (anonymous mmaps, so O_DIRECT can fill them), reused by size."""

    def __init__(self, max_idle_bytes: int = 64 << 20) -> None:
        self.max_idle = max_idle_bytes
        self.idle = 0
        self._free: dict[int, list[mmap.mmap]] = {}
        self._lock = threading.Lock()

    @staticmethod
    def bucket(n: int) -> int:
        return max(64 << 10, 1 << max(0, (n - 1).bit_length()))

    def get(self, n: int) -> mmap.mmap:
        b = self.bucket(n)
        with self._lock:
            free = self._free.get(b)
            if free:
                self.idle -= b
                return free.pop()
        return mmap.mmap(-1, b)

    def put(self, mm: mmap.mmap) -> None:
        with self._lock:
            if self.idle + len(mm) <= self.max_idle:
                self._free.setdefault(len(mm), []).append(mm)
                self.idle += len(mm)
                return
        try:
            mm.close()
        except BufferError:  # a view still exists: let the GC close it
            pass



SLOW_READ_S = 0.5  # what the ``disk_read_slow`` failpoint adds to a record read


def _maybe_slow() -> None:
    """The ``disk_read_slow`` failpoint: a device that takes ``SLOW_READ_S`` longer."""
    if failpoint("disk_read_slow"):
        time.sleep(SLOW_READ_S)


class SegmentLog:
    """The disk tier's records, index and segments. See the module docstring."""

    def __init__(self, disk_dir: str, name: str, *, capacity_bytes: int, segment_bytes: int,
                 max_value_bytes: int, max_key_bytes: int = 512, max_namespace_bytes: int = 128,
                 direct_io: bool = True, eviction_policy: EvictionPolicy | None = None,
                 events: EventQueue | None = None) -> None:
        """``eviction_policy``: orders the live records for compaction and quota
        evictions (see the module docstring); None: write order and ``ref`` bits only.
        ``events``: told of every index change after recovery (``kv_events``), with
        ``self.lock`` held."""
        if segment_bytes % BLOCK or segment_bytes < (1 << 20):
            raise DiskError(f"segment_bytes {segment_bytes} must be a multiple of 4KiB and "
                            ">= 1MiB; fix --segment-bytes")
        hdr_max = record_geometry(max_namespace_bytes, max_key_bytes, max_value_bytes,
                                  True)[0]
        self.max_record = align(hdr_max + max_value_bytes)
        if segment_bytes < BLOCK + 2 * self.max_record:
            raise DiskError(f"segment_bytes {segment_bytes} cannot hold two of the largest "
                            f"records ({self.max_record} bytes); raise --segment-bytes to at "
                            f"least {align(BLOCK + 2 * self.max_record, 1 << 20)} or lower "
                            "--slab-bytes")
        self.segment_bytes = segment_bytes
        self.max_segments = capacity_bytes // segment_bytes
        if self.max_segments < 4:
            raise DiskError(f"disk capacity {capacity_bytes} holds fewer than 4 segments of "
                            f"{segment_bytes} bytes; raise --disk or lower --segment-bytes")
        self.capacity = self.max_segments * segment_bytes
        self.dead_bytes = segment_bytes // BLOCK * DEAD.size
        self.root = tier_root(disk_dir, name)
        try:
            os.makedirs(self.root, mode=0o700, exist_ok=True)
            self._lock_fd = os.open(os.path.join(self.root, "LOCK"), os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as exc:
            raise DiskError(f"cannot use disk directory {self.root}: {exc.strerror}; check "
                            "--disk-dir and its permissions") from None
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(self._lock_fd)
            raise DiskError(f"disk directory {self.root} is in use by another gcache-server; "
                            "give this server a different --name or --disk-dir") from None
        self.direct = direct_io and hasattr(os, "O_DIRECT")
        self.lock = ranked_lock(LockRank.DISK)
        self.index: dict[tuple[bytes, bytes], Entry] = {}
        self.policy = eviction_policy
        self._objs: dict[tuple[bytes, bytes], _DiskObj] = {}  # the policy's, per live key
        self._ns: dict[bytes, _NsDisk] = {}  # namespaces with live records
        self.segments: dict[int, Segment] = {}
        self.active: Segment | None = None
        self.next_seg_id = 1
        self.max_version = 0
        self.live_bytes = 0
        self.degraded = ""
        self.pool = BufferPool()
        wbuf_bytes = max(8 << 20, align(self.max_record, 1 << 20))
        self._wbuf = mmap.mmap(-1, wbuf_bytes)
        self._wv = memoryview(self._wbuf)
        self._wused = 0
        self._hdr_block = mmap.mmap(-1, BLOCK)
        self.counters = {"disk_hits": 0, "disk_read_bytes": 0, "disk_written_bytes": 0,
                         "disk_corrupt_dropped": 0, "disk_read_errors": 0,
                         "disk_write_errors": 0, "disk_evictions": 0, "disk_carried_over": 0,
                         "disk_compactions": 0, "disk_recovered": 0, "disk_dead_unpersisted": 0,
                         "disk_quota_killed": 0}
        self._events: EventQueue | None = None  # recovered records are announced apart
        self.recovery = self._recover()
        self._events = events

    # ------------------------------------------------------------------ files
    def _open_flags(self) -> int:
        return os.O_RDWR | (os.O_DIRECT if self.direct else 0)

    def _open(self, path: str, create: bool) -> int:
        flags = self._open_flags() | (os.O_CREAT | os.O_EXCL if create else 0)
        try:
            return os.open(path, flags, 0o600)
        except OSError as exc:
            if exc.errno != errno.EINVAL or not self.direct:
                raise
        log.warning("O_DIRECT is not supported on %s; the disk tier uses buffered IO",
                    self.root)
        self.direct = False
        return os.open(path, self._open_flags() | (os.O_CREAT if create else 0), 0o600)

    def _seg_path(self, seg_id: int) -> str:
        return os.path.join(self.root, f"seg-{seg_id:08d}.log")

    def _write_seg_header(self, seg: Segment, sealed_len: int) -> None:
        hb = self._hdr_block
        pack_segment_header(hb, seg.id, seg.salt, self.segment_bytes, seg.created_ns,
                            sealed_len)
        mv = memoryview(hb)
        try:
            pwrite_all(seg.fd, mv, 0)
        finally:
            mv.release()

    def _open_segment(self) -> bool:
        """Create the next segment and make it active. False (and degraded) on failure."""
        if len(self.segments) >= self.max_segments:
            return False
        seg_id = self.next_seg_id
        path = self._seg_path(seg_id)
        fd = dead_fd = -1
        try:
            os_error("disk_full", "enospc", "allocating a segment")
            fd = self._open(path, create=True)
            os.posix_fallocate(fd, 0, self.segment_bytes)
            dead_fd = os.open(path[:-4] + ".dead", os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
            os.posix_fallocate(dead_fd, 0, self.dead_bytes)
            seg = Segment(seg_id, path, fd, dead_fd, int.from_bytes(os.urandom(8), "little"),
                          BLOCK, time.time_ns())
            os_error("disk_write", "eio", "writing a segment header")
            self._write_seg_header(seg, 0)
        except OSError as exc:
            for f in (fd, dead_fd):
                if f >= 0:
                    os.close(f)
            for p in (path, path[:-4] + ".dead"):
                try:
                    os.unlink(p)
                except OSError:
                    pass
            self._count("disk_write_errors")
            self._degrade(f"cannot allocate segment {path} ({exc.strerror or exc})")
            return False
        self.next_seg_id += 1
        with self.lock:
            self.segments[seg_id] = seg
        self.active = seg
        return True

    def _seal_active(self) -> None:
        seg = self.active
        self.active = None
        if seg is None:
            return
        seg.sealed = True
        try:
            self._write_seg_header(seg, seg.write_off)
        except OSError as exc:  # the scan then reads to the segment's end; not fatal
            self._count("disk_write_errors")
            log.warning("could not seal segment %s: %s", seg.path, exc)

    def _count(self, name: str, n: int = 1) -> None:
        with self.lock:
            self.counters[name] += n

    def _degrade(self, why: str) -> None:
        if not self.degraded:
            log.error("disk tier degraded to memory-only: %s; free space on %s or replace the "
                      "device; gcache keeps serving from memory and retries every second",
                      why, self.root)
        self.degraded = why

    def probe(self) -> bool:
        """Mover: try to leave the degraded state. True when the tier can write again."""
        if not self.degraded:
            return True
        why = self.degraded
        self.degraded = ""
        if self.active is not None:
            self._seal_active()  # never append after a failed write
        if len(self.segments) < self.max_segments:
            ok = self._open_segment()
        else:
            ok = self._probe_write()
        if ok and not self.degraded:
            log.info("disk tier recovered: writes resume (was: %s)", why)
            return True
        if not self.degraded:
            self.degraded = why
        return False

    def _probe_write(self) -> bool:
        path = os.path.join(self.root, "probe")
        try:
            os_error("disk_write", "eio", "probing")
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                os.posix_fallocate(fd, 0, BLOCK)
                os.pwrite(fd, ZEROS, 0)
                os.fsync(fd)
            finally:
                os.close(fd)
                os.unlink(path)
            return True
        except OSError as exc:
            self._degrade(f"probe write failed ({exc.strerror or exc})")
            return False

    # ------------------------------------------------------------------ index
    def exists(self, ns: bytes, key: bytes) -> bool:
        return (ns, key) in self.index

    def do_has(self, ns: bytes, key: bytes, version: int) -> bool:
        e = self.index.get((ns, key))
        return e is not None and e.version == version

    def has(self, ns: bytes, key: bytes, version: int) -> bool:
        with self.lock:
            return self.do_has(ns, key, version)

    # ------------------------------------------------------------------ namespaces
    def do_ns_add(self, ns: bytes, key: bytes, e: Entry) -> None:
        u = self._ns.get(ns)
        if u is None:
            u = self._ns[ns] = _NsDisk()
        u.bytes += e.rec_len
        u.keys.pop(key, None)
        u.keys[key] = None

    def do_ns_sub(self, ns: bytes, key: bytes, e: Entry) -> None:
        u = self._ns[ns]
        u.bytes -= e.rec_len
        u.keys.pop(key, None)
        if not u.keys:
            del self._ns[ns]

    def do_ns_bytes(self, ns: bytes) -> int:
        u = self._ns.get(ns)
        return u.bytes if u is not None else 0

    def namespace_bytes(self) -> dict[bytes, int]:
        """Live record bytes per namespace."""
        with self.lock:
            return {ns: u.bytes for ns, u in self._ns.items()}

    def fit_quota(self, ns: bytes, limit: int, want: int) -> tuple[int, bool]:
        """Kill ``ns``'s oldest records until its live bytes plus ``want`` fit ``limit``
        (a disk quota); returns how many died and whether it fits now."""
        killed = 0
        with self.lock:
            while self.do_ns_bytes(ns) + want > limit and self.do_evict_oldest(ns):
                killed += 1
            return killed, self.do_ns_bytes(ns) + want <= limit

    @staticmethod
    def record_bytes(ns: bytes, key: bytes, length: int, placed: bool = False) -> int:
        """Disk bytes a record of this object takes (``placed``: with a placement hash)."""
        return record_geometry(len(ns), len(key), length, placed)[1]

    def do_evict_oldest(self, ns: bytes) -> int:
        """Kill ``ns``'s oldest live record, or with a policy its first candidate (a
        quota eviction; its death is persisted). Returns the record bytes freed, 0 when
        the namespace has none."""
        u = self._ns.get(ns)
        if u is None:
            return 0
        if self.policy is not None:
            key = next(iter(self.policy.candidates(ns))).key
        else:
            key = next(iter(u.keys))
        e = self.index[(ns, key)]
        self.do_kill(ns, key, e)
        self.counters["disk_quota_killed"] += 1
        return e.rec_len

    def do_insert(self, ns: bytes, key: bytes, e: Entry) -> bool:
        """Publish a written record. The higher version wins; the loser dies. True if live."""
        old = self.index.get((ns, key))
        seg = self.segments.get(e.seg)
        if seg is None or seg.retired:
            return False
        if old is not None:
            if old.version > e.version:
                self.do_kill(ns, key, e, indexed=False)
                return False
            self.do_kill(ns, key, old)
        self.do_link(ns, key, e, seg)
        return True

    def do_link(self, ns: bytes, key: bytes, e: Entry, seg: Segment) -> None:
        """Index the live record ``e`` (in ``seg``): the index, its namespace (newest
        last), its segment's live set and the live bytes. The one place that adds."""
        k = (ns, key)
        self.index[k] = e
        if self.policy is not None:
            self.do_policy_link(k, e)
        self.do_ns_add(ns, key, e)
        seg.keys.add(k)
        seg.live_bytes += e.rec_len
        self.live_bytes += e.rec_len
        if self._events is not None:
            self._events.stored(ns, key)

    def do_unlink(self, ns: bytes, key: bytes, e: Entry, seg: Segment | None) -> None:
        """Undo ``do_link`` for ``e`` (whatever of it still holds). The one place that
        removes."""
        k = (ns, key)
        if self.index.get(k) is e:
            del self.index[k]
            if self.policy is not None:
                self.policy.on_remove(self._objs.pop(k))
            self.do_ns_sub(ns, key, e)
            if self._events is not None:
                self._events.removed(ns, key)
        if seg is not None and k in seg.keys:
            seg.keys.discard(k)
            seg.live_bytes -= e.rec_len
            self.live_bytes -= e.rec_len

    def do_policy_link(self, k: tuple[bytes, bytes], e: Entry) -> None:
        """Tell the policy that ``e`` is ``k``'s live record now (newest)."""
        old = self._objs.get(k)
        if old is not None:  # relinked without an unlink (recovery): forget the old one
            self.policy.on_remove(old)
        o = self._objs[k] = _DiskObj(k[0], k[1], e)
        self.policy.on_insert(o)

    def do_carry(self, ns: bytes, key: bytes, e: Entry) -> None:
        """Publish ``e``, compaction's rewrite of the live record of ``(ns, key)``: the
        policy keeps its object and its place (a rewrite is not a use, nor a new key)."""
        k = (ns, key)
        o, pol = self._objs.get(k), self.policy
        self.policy = None  # the lock is held: nothing else sees the policy meanwhile
        try:
            self.do_insert(ns, key, e)
        finally:
            self.policy = pol
        if o is not None and self.index.get(k) is e:
            o.e = e

    def do_cold_set(self) -> tuple[set[int], dict[int, int]]:
        """The policy's first candidates in sealed segments, until they hold one
        segment's bytes: ``(id() of their entries, their bytes per segment id)``. What
        compaction gives up first (``tiering.PolicyOrder``)."""
        cold: set[int] = set()
        per_seg: dict[int, int] = {}
        if self.policy is None:
            return cold, per_seg
        active = self.active.id if self.active is not None else -1
        got = 0
        for o in self.policy.candidates():
            e = o.e
            if e.seg == active:
                continue
            cold.add(id(e))
            per_seg[e.seg] = per_seg.get(e.seg, 0) + e.rec_len
            got += e.rec_len
            if got >= self.segment_bytes:
                break
        return cold, per_seg

    def do_kill(self, ns: bytes, key: bytes, e: Entry, indexed: bool = True) -> None:
        """Forget a record and persist its death (so a restart cannot resurrect it)."""
        seg = self.segments.get(e.seg)
        if indexed:
            self.do_unlink(ns, key, e, seg)
        if seg is None or seg.retired:
            return
        if seg.dead_next + DEAD.size > self.dead_bytes:
            self.counters["disk_dead_unpersisted"] += 1
            return
        ent = pack_death(e.off, e.version, seg.salt)
        try:
            os_error("disk_dead_write", "eio", "recording a death")
            os.pwrite(seg.dead_fd, ent, seg.dead_next)
            seg.dead_next += DEAD.size
        except OSError as exc:
            self.counters["disk_dead_unpersisted"] += 1
            self.counters["disk_write_errors"] += 1
            log.warning("could not record a deletion in %s (%s); a crash before the next "
                        "clean stop may bring the old object back", seg.dead_path, exc)

    def do_invalidate_below(self, ns: bytes, key: bytes, version: int) -> bool:
        """A newer object now lives in memory: kill any older disk copy."""
        e = self.index.get((ns, key))
        if e is not None and e.version < version:
            self.do_kill(ns, key, e)
            return True
        return False

    def invalidate_below(self, ns: bytes, key: bytes, version: int) -> bool:
        with self.lock:
            return self.do_invalidate_below(ns, key, version)

    def publish(self, ns: bytes, key: bytes, e: Entry) -> bool:
        """Make a record ``append`` wrote visible (see ``do_insert``)."""
        with self.lock:
            return self.do_insert(ns, key, e)

    def discard(self, ns: bytes, key: bytes, e: Entry) -> None:
        """A written record that was not published: persist its death unless it is the
        indexed one."""
        with self.lock:
            if self.index.get((ns, key)) is not e:
                self.do_kill(ns, key, e, indexed=False)

    def supersede(self, versions: Mapping[tuple[bytes, bytes], int]
                  ) -> tuple[int, list[tuple[bytes, bytes, int]]]:
        """One version per key (startup): kill each record older than ``versions``'
        version of its key; returns how many died and the ``(ns, key, version)`` of
        ``versions`` that a newer record here supersedes."""
        killed, newer = 0, []
        with self.lock:
            for (ns, key), v in versions.items():
                e = self.index.get((ns, key))
                if e is None or e.version == v:
                    continue
                if e.version < v:
                    self.do_kill(ns, key, e)
                    killed += 1
                else:
                    newer.append((ns, key, v))
        return killed, newer

    def delete(self, ns: bytes, key: bytes) -> bool:
        with self.lock:
            e = self.index.get((ns, key))
            if e is None:
                return False
            self.do_kill(ns, key, e)
            return True

    def delete_version(self, ns: bytes, key: bytes, version: int) -> bool:
        with self.lock:
            e = self.index.get((ns, key))
            if e is None or e.version != version:
                return False
            self.do_kill(ns, key, e)
            return True

    def held(self) -> Iterator[HeldObject]:
        """The live records as ``HeldObject``s, a chunked snapshot (never blocks on IO)."""
        return held_snapshot(self.lock, self.index,
                             lambda k, e: HeldObject(k[0], k[1], e.length, e.version, e.ph))

    def touch(self, ns: bytes, key: bytes) -> bool:
        if self.policy is not None:
            with self.lock:
                o = self._objs.get((ns, key))
                if o is None:
                    return False
                o.e.ref = True
                self.policy.on_hit(o)
                return True
        e = self.index.get((ns, key))
        if e is None:
            return False
        e.ref = True
        return True

    # ------------------------------------------------------------------ reads
    def read(self, ns: bytes, key: bytes, offset: int, max_len: int,
             expect_version: int, internal: bool = False) -> Pinned:
        """Read and verify (part of) a record. The view is over a private, verified buffer.

        Status: OK, MISS, CONFLICT (version differs), CORRUPT (checksum failed: dropped
        and counted), ERROR (the device failed the read: dropped and counted).
        ``internal`` reads (promotion, compaction) neither count as hits nor mark the
        record hot.
        """
        with self.lock:
            e = self.index.get((ns, key))
            if e is None:
                return Pinned(Status.MISS)
            if expect_version and e.version != expect_version:
                return Pinned(Status.CONFLICT, e.length, e.version)
            seg = self.segments[e.seg]
            seg.readers += 1
            if not internal:
                e.ref = True
                if offset == 0:
                    self.counters["disk_hits"] += 1
                    if self.policy is not None:
                        self.policy.on_hit(self._objs[(ns, key)])
        start = min(offset, e.length)
        end = min(e.length, start + max_len)
        lease = ReadLease(None, ns, key, e.version, e.length, e.checksum, first=offset == 0,
                          ph=e.ph)
        try:
            if end <= start:  # nothing to read: the segment's reader goes back at once
                self._release_seg(seg, 0)
                return Pinned(Status.OK, e.length, e.version, memoryview(b""), lease,
                              e.checksum)
            nchunks = (e.length + (1 << e.chunk_shift) - 1) >> e.chunk_shift
            if nchunks <= 1 or (start == 0 and end == e.length):
                view, why = self._read_whole(seg, e, ns, key, lease, start, end)
            else:
                view, why = self._read_chunks(seg, e, ns, key, lease, start, end, nchunks)
        except OSError as exc:
            self._release_seg(seg, 0)
            self._drop(ns, key, e, "disk_read_errors", f"read failed: {exc}", lease)
            return Pinned(Status.ERROR)
        self._release_seg(seg, len(view) if view is not None and not internal else 0)
        if view is None:
            self._drop(ns, key, e, "disk_corrupt_dropped", why, lease)
            return Pinned(Status.CORRUPT)
        return Pinned(Status.OK, e.length, e.version, view, lease, e.checksum)

    def read_many(self, ns: bytes, items: list[tuple[bytes, int, int, int]],
                  dest: ScratchSource | None = None) -> list[Pinned]:
        """``read`` for several items ``(key, offset, max_len, expect_version)`` of one
        namespace, with the same statuses, counters and drops item by item. The lookups
        take one lock hold; every whole-record read is issued and checksummed in one
        ``native.pread_records`` call, so the GIL is released once per group instead of
        once per item (a reader thread's next read no longer waits for a contended
        hand-off). Sliced reads of chunked records and empty ranges go through ``read``.
        ``dest``: records are read into ``dest(record bytes)`` instead of pooled
        buffers (``ReadLease.scratch``); an item it has no room for, or one that would
        go through ``read``, answers BUSY without a read."""
        out: list[Pinned | None] = [None] * len(items)
        group: list[tuple[int, bytes, Entry, Segment, int, int]] = []
        with self.lock:
            for i, (key, offset, max_len, expect_version) in enumerate(items):
                e = self.index.get((ns, key))
                if e is None:
                    out[i] = Pinned(Status.MISS)
                    continue
                if expect_version and e.version != expect_version:
                    out[i] = Pinned(Status.CONFLICT, e.length, e.version)
                    continue
                start = min(offset, e.length)
                end = min(e.length, start + max_len)
                whole = start == 0 and end == e.length
                if end <= start or not (whole or e.length <= 1 << e.chunk_shift):
                    if dest is not None:
                        out[i] = Pinned(Status.BUSY)
                    continue  # ``read`` below
                seg = self.segments[e.seg]
                seg.readers += 1
                e.ref = True
                if offset == 0:
                    self.counters["disk_hits"] += 1
                    if self.policy is not None:
                        self.policy.on_hit(self._objs[(ns, key)])
                group.append((i, key, e, seg, start, end))
        if group:
            self._read_group(ns, group, out, dest)
        try:
            for i, p in enumerate(out):
                if p is None:
                    out[i] = self.read(ns, *items[i])
        except BaseException:  # never leak the group's pins: the caller gets none
            for p in out:
                if p is not None and p.token is not None:
                    if p.view is not None:
                        p.view.release()
                    self.release(p.token)
            raise
        return out  # type: ignore[return-value]

    def _read_group(self, ns: bytes, group: list[tuple[int, bytes, Entry, Segment, int, int]],
                    out: list[Pinned | None], dest: ScratchSource | None = None) -> None:
        """Read, verify and lease ``group``'s whole records (``read_many``), into pooled
        buffers or ``dest``'s; every segment reader taken there is given back here,
        whatever happens."""
        leases: list[ReadLease] = []
        bufs: list[Any] = []  # each lease's buffer: its pooled mmap, or dest's view
        unread = 0  # hits read_many counted that dest had no room for (read by a GET)
        failed: dict[int, str] = {}  # group index -> why the read failed
        served: list[int] = [0] * len(group)
        drops: list[tuple[int, str, str]] = []  # (group index, counter, why)
        try:
            spans, at = [], []
            for k, (i, key, e, seg, start, _end) in enumerate(group):
                lease = ReadLease(None, ns, key, e.version, e.length, e.checksum,
                                  first=start == 0, ph=e.ph)
                leases.append(lease)
                if dest is None:
                    lease.mm = self.pool.get(e.rec_len)
                    bufs.append(lease.mm)
                else:
                    got = dest(e.rec_len)
                    bufs.append(None if got is None else got[0])
                    if got is None:  # no room: not read, answered BUSY
                        out[i] = Pinned(Status.BUSY)
                        unread += start == 0
                        continue
                    lease.scratch = (got[1], e.hdr_len + start)
                try:
                    os_error("disk_read", "eio", "reading a record")
                except OSError as exc:
                    failed[k] = str(exc)
                    continue
                spans.append((seg.fd, memoryview(bufs[k])[:e.rec_len], e.off, e.hdr_len,
                              e.hdr_len + e.length))
                at.append(k)
            _maybe_slow()
            try:
                digests, errs = native.pread_records(spans)
            finally:
                for span in spans:
                    span[1].release()
            for j, err in errs:
                e = group[at[j]][2]
                failed[at[j]] = (os.strerror(err) if err else
                                 f"short read at offset {e.off} (end of file)")
            for j, k in enumerate(at):
                if k in failed:
                    continue
                i, key, e, _seg, start, end = group[k]
                mv = memoryview(bufs[k])
                data = mv[e.hdr_len:e.hdr_len + e.length]
                digest = digests[j]
                if self._maybe_corrupt(mv, e.hdr_len, e.length):
                    digest = checksum(data)
                why = check_fields(mv, e, ns, key) or (
                    "data checksum mismatch" if digest != e.checksum else "")
                if why:
                    data.release()
                    drops.append((k, "disk_corrupt_dropped", why))
                else:
                    leases[k].whole = data
                    view = mv[e.hdr_len + start:e.hdr_len + end]
                    out[i] = Pinned(Status.OK, e.length, e.version, view, leases[k], e.checksum)
                    served[k] = len(view)
                mv.release()
        except BaseException:
            for i, *_rest in group:
                if out[i] is not None and out[i].view is not None:
                    out[i].view.release()
                out[i] = None
            for lease in leases:
                self.release(lease)
            raise
        finally:
            with self.lock:
                self.counters["disk_hits"] -= unread
                for k, (_i, _key, _e, seg, _s, _t) in enumerate(group):
                    seg.readers -= 1
                    if seg.retired and seg.readers == 0:
                        seg.close()
                    self.counters["disk_read_bytes"] += served[k]
        drops += [(k, "disk_read_errors", f"read failed: {why}") for k, why in failed.items()]
        for k, counter, why in drops:
            i, key, e = group[k][:3]
            self._drop(ns, key, e, counter, why, leases[k])
            out[i] = Pinned(Status.ERROR if counter == "disk_read_errors" else Status.CORRUPT)

    def _release_seg(self, seg: Segment, served: int) -> None:
        with self.lock:
            seg.readers -= 1
            if seg.retired and seg.readers == 0:
                seg.close()
            self.counters["disk_read_bytes"] += served

    def _drop(self, ns: bytes, key: bytes, e: Entry, counter: str, why: str,
              lease: ReadLease) -> None:
        self.release(lease)
        with self.lock:
            self.counters[counter] += 1
            if self.index.get((ns, key)) is e:
                self.do_kill(ns, key, e)
        log.error("dropped disk record: %s", why, extra={"fields": {
            "ns": ns, "key": key, "segment": e.seg, "offset": e.off, "bytes": e.length}})

    def _read_whole(self, seg: Segment, e: Entry, ns: bytes, key: bytes, lease: ReadLease,
                    start: int, end: int) -> tuple[memoryview | None, str]:
        mm = lease.mm = self.pool.get(e.rec_len)
        mv = memoryview(mm)
        try:
            os_error("disk_read", "eio", "reading a record")
            _maybe_slow()
            pread_into(seg.fd, mv[:e.rec_len], e.off)
            self._maybe_corrupt(mv, e.hdr_len, e.length)
            why = check_fields(mv, e, ns, key)
            if why:
                return None, why
            data = mv[e.hdr_len:e.hdr_len + e.length]
            if checksum(data) != e.checksum:
                data.release()
                return None, "data checksum mismatch"
            lease.whole = data
            return mv[e.hdr_len + start:e.hdr_len + end], ""
        finally:
            mv.release()

    def _read_chunks(self, seg: Segment, e: Entry, ns: bytes, key: bytes, lease: ReadLease,
                     start: int, end: int, nchunks: int) -> tuple[memoryview | None, str]:
        shift = e.chunk_shift
        c0, c1 = start >> shift, (end + (1 << shift) - 1) >> shift
        dlo = e.hdr_len + (c0 << shift)  # record-relative
        dhi = e.hdr_len + min(c1 << shift, e.length)
        alo, ahi = dlo // BLOCK * BLOCK, align(dhi)
        hdr_pages = align(e.hdr_len)
        sep = alo > (64 << 10)  # far from the header: read it separately
        base = hdr_pages - alo if sep else 0  # buffer index = record offset + base
        mm = lease.mm = self.pool.get((hdr_pages if sep else 0) + ahi - (alo if sep else 0))
        mv = memoryview(mm)
        try:
            os_error("disk_read", "eio", "reading a record")
            _maybe_slow()
            if sep:
                pread_into(seg.fd, mv[:hdr_pages], e.off)
                pread_into(seg.fd, mv[hdr_pages:hdr_pages + ahi - alo], e.off + alo)
            else:
                pread_into(seg.fd, mv[:ahi], e.off)
            self._maybe_corrupt(mv, dlo + base, dhi - dlo)
            why = self._check_header(mv, e, ns, key, seg)
            if why:
                return None, why
            p = sums_offset(len(ns), len(key), e.ph is not None)
            sums = struct.unpack_from(f"<{nchunks}Q", mv, p)
            for c in range(c0, c1):
                a = base + e.hdr_len + (c << shift)
                b = base + e.hdr_len + min((c + 1) << shift, e.length)
                if checksum(mv[a:b]) != sums[c]:
                    return None, f"chunk {c} checksum mismatch"
            return mv[base + e.hdr_len + start:base + e.hdr_len + end], ""
        finally:
            mv.release()

    @staticmethod
    def _maybe_corrupt(mv: memoryview, data_at: int, length: int) -> bool:
        if length and failpoint("disk_read_corrupt"):
            mv[data_at + length // 2] ^= 0x5A
            return True
        return False

    def _check_header(self, mv: memoryview, e: Entry, ns: bytes, key: bytes,
                      seg: Segment) -> str:
        """Sliced read: the chunk checksums come from the header, so its CRC must hold."""
        rec = parse_header(mv, seg.salt, seg.id, e.off, self.segment_bytes)
        if rec is None:
            return "record header invalid (magic, geometry or CRC)"
        rns, rkey, re_, _n = rec
        if (rns, rkey) != (ns, key) or re_.version != e.version or re_.length != e.length \
                or re_.checksum != e.checksum:
            return "record header names another object"
        return ""

    def release(self, lease: ReadLease | None) -> None:
        """Give a read's buffer back (after the reply was sent). A read into a caller's
        destination (``lease.scratch``) only lets go of its view: the caller frees it."""
        if lease is None:
            return
        if lease.whole is not None:
            lease.whole.release()
            lease.whole = None
        mm, lease.mm = lease.mm, None
        if mm is not None:
            self.pool.put(mm)

    def read_whole(self, ns: bytes, key: bytes, version: int) -> Pinned:
        """A verified read of a whole object (promotion, compaction)."""
        p = self.read(ns, key, 0, 1 << 62, version, internal=True)
        if p.status == Status.OK and p.token is not None and p.token.whole is None:
            p.token.whole = p.view  # zero-length object
        return p

    # ------------------------------------------------------------------ writes (mover)
    def append(self, items: list[DemoteItem]) -> list[Entry | Status]:
        """Write records (``DemoteItem``: ns, key, version, data, checksum, created_ns,
        placement hash); mover thread only.

        Returns per item the written (not yet published: see ``do_insert``) Entry, or
        CORRUPT (the source did not match its checksum: never written), or NO_SPACE
        (the tier is full or degraded).
        """
        out: list[Entry | Status] = []
        pending: list[int] = []
        for ns, key, version, data, csum, created, ph in items:
            if self.degraded:
                out.append(Status.NO_SPACE)
                continue
            hdr_len, rec_len, nchunks, shift = record_geometry(len(ns), len(key), len(data),
                                                               ph is not None)
            seg = self.active
            if seg is None or seg.write_off + self._wused + rec_len > self.segment_bytes:
                self._flush(out, pending)
                self._seal_active()
                if self.degraded or not self._open_segment():
                    out.append(Status.NO_SPACE)
                    continue
                seg = self.active
            if self._wused + rec_len > len(self._wbuf):
                if not self._flush(out, pending):
                    out.append(Status.NO_SPACE)
                    continue
            off = seg.write_off + self._wused
            if not build_record(self._wv, self._wused, seg.salt, seg.id, off, ns, key, version,
                                data, csum, created, hdr_len, rec_len, nchunks, shift, ph):
                out.append(Status.CORRUPT)
                continue
            self._wused += rec_len
            out.append(Entry(seg.id, off, rec_len, hdr_len, len(data), version, csum, shift,
                             ph=ph))
            pending.append(len(out) - 1)
            self.max_version = max(self.max_version, version)
        self._flush(out, pending)
        return out

    def _flush(self, out: list[Entry | Status], pending: list[int]) -> bool:
        """Write the buffer with one pwrite. On failure the buffered records are NO_SPACE."""
        n = self._wused
        if n == 0:
            return True
        seg = self.active
        try:
            os_error("disk_write", "eio", "writing records")
            pwrite_all(seg.fd, self._wv[:n], seg.write_off)
        except OSError as exc:
            self._count("disk_write_errors")
            for i in pending:
                out[i] = Status.NO_SPACE
            pending.clear()
            self._wused = 0
            self._degrade(f"write to {seg.path} failed ({exc.strerror or exc})")
            self._seal_active()  # never append after a failed write
            return False
        seg.write_off += n
        self._count("disk_written_bytes", n)
        self._wused = 0
        pending.clear()
        return True

    # ------------------------------------------------------------------ compaction (mover)
    def needs_compaction(self) -> bool:
        """True when only the reserve segment slot is left (and a sealed victim exists)."""
        return (len(self.segments) >= self.max_segments - 1
                and any(s is not self.active for s in self.segments.values()))

    def compact_one(self, policy: CompactionPolicy | None = None) -> dict[str, int]:
        """Reclaim the sealed segment ``policy.victim`` picks (mover thread only; default
        ``tiering.SecondChance``: the fewest live bytes).

        Records for which ``policy.carry`` is true are rewritten at the head of the log
        with their ``ref`` cleared; the others are dropped (``disk_evictions``). With
        ``policy.wants_order``, the eviction policy's first candidates (``do_cold_set``)
        are dropped whatever ``carry`` says. Returns what happened.
        """
        policy = policy or _SECOND_CHANCE
        if policy.wants_order and self.policy is None:
            policy = _SECOND_CHANCE  # nothing to order by: no cold marks, carry all
        with self.lock:
            if not any(s is not self.active for s in self.segments.values()):
                return {"carried": 0, "dropped": 0}
            cold, cold_bytes = (self.do_cold_set() if policy.wants_order
                                else (set(), {}))
            sealed = [SealedSegment(s.id, s.live_bytes, s.created_ns, cold_bytes.get(s.id, 0))
                      for s in self.segments.values() if s is not self.active]
            victim = self.segments[policy.victim(sealed)]
            live = [(k, self.index[k]) for k in victim.keys]
        hot = [(k, e) for k, e in live if id(e) not in cold and policy.carry(k[0], k[1], e)]
        carried = 0
        for i in range(0, len(hot), 64):
            if self.degraded:
                break
            reads = []
            for (ns, key), e in hot[i:i + 64]:
                p = self.read_whole(ns, key, e.version)
                if p.status == Status.OK:
                    reads.append((ns, key, e, p))
            try:
                res = self.append([DemoteItem(ns, key, e.version, p.token.whole, e.checksum,
                                              0, e.ph) for ns, key, e, p in reads])
                with self.lock:
                    for (ns, key, e, _p), r in zip(reads, res):
                        if isinstance(r, Entry) and self.index.get((ns, key)) is e:
                            self.do_carry(ns, key, r)
                            carried += 1
                        elif isinstance(r, Entry):  # deleted or replaced meanwhile
                            self.do_kill(ns, key, r, indexed=False)
            finally:
                for *_x, p in reads:
                    p.view.release()
                    self.release(p.token)
        with self.lock:
            dropped = 0
            for k in list(victim.keys):
                e = self.index.get(k)
                if e is not None and e.seg == victim.id:
                    self.do_unlink(k[0], k[1], e, victim)
                    dropped += 1
            victim.keys.clear()
            victim.live_bytes = 0
            del self.segments[victim.id]
            victim.retired = True
            if victim.readers == 0:
                victim.close()
            self.counters["disk_evictions"] += dropped
            self.counters["disk_carried_over"] += carried
            self.counters["disk_compactions"] += 1
        for p in (victim.path, victim.dead_path):
            try:
                os.unlink(p)
            except OSError:
                pass
        return {"carried": carried, "dropped": dropped, "segment": victim.id}

    # ------------------------------------------------------------------ startup
    def _recover(self) -> dict:
        t0 = time.monotonic()
        files = segment_paths(self.root)
        source, reason = "scan", "no index file (first start or the last stop was a crash)"
        counts = {"corrupt": 0, "superseded": 0, "dead": 0, "bad_segments": 0}
        raw = take_index_file(self.root)  # consumed: a later crash must not reuse it
        if raw is not None:
            try:
                self._load_index(raw, files)
                source, reason = "index", "clean stop"
            except (ValueError, OSError, struct.error) as exc:
                reason = f"index file unusable ({exc})"
                self._reset_state()
        if source == "scan":
            self._scan(files, counts)
        self.counters["disk_recovered"] = len(self.index)
        free = _free_bytes(self.root)
        if free is not None and free + len(self.segments) * self.segment_bytes < self.capacity:
            log.warning("disk tier capacity %d bytes exceeds what %s can hold (%d bytes free); "
                        "the tier will degrade to memory-only when the filesystem fills; lower "
                        "--disk", self.capacity, self.root, free)
        return {"source": source, "reason": reason, "objects": len(self.index),
                "segments": len(self.segments), "max_version": self.max_version,
                "direct_io": self.direct, **counts, "seconds": time.monotonic() - t0}

    def _reset_state(self) -> None:
        for s in self.segments.values():
            s.close()
        self.segments.clear()
        self.index.clear()
        self._ns.clear()
        self.live_bytes = 0
        self.max_version = 0

    def _open_existing(self, seg_id: int, path: str) -> Segment | None:
        try:
            fd = self._open(path, create=False)
        except OSError as exc:
            log.error("cannot open segment %s (%s); skipping it", path, exc)
            return None
        hdr = read_segment_header(fd)
        if hdr is None or hdr[0] != seg_id or hdr[2] != self.segment_bytes:
            os.close(fd)
            return None
        try:
            dead_fd = os.open(path[:-4] + ".dead", os.O_RDWR | os.O_CREAT, 0o600)
            if os.fstat(dead_fd).st_size < self.dead_bytes:
                os.posix_fallocate(dead_fd, 0, self.dead_bytes)
        except OSError as exc:
            log.error("cannot open %s.dead (%s); skipping segment", path[:-4], exc)
            os.close(fd)
            return None
        seg = Segment(seg_id, path, fd, dead_fd, hdr[1], hdr[4] or self.segment_bytes, hdr[3])
        seg.sealed = True
        return seg

    def _deaths(self, seg: Segment) -> set[tuple[int, int]]:
        """The segment's recorded deaths; sets where its next death entry goes."""
        out, nxt = parse_deaths(os.pread(seg.dead_fd, self.dead_bytes, 0), seg.salt)
        if nxt:
            seg.dead_next = nxt
        return out

    def _scan(self, files: list[tuple[int, str]], counts: dict[str, int]) -> None:
        merge = ScanMerge(counts)
        for seg_id, path in files:
            self.next_seg_id = max(self.next_seg_id, seg_id + 1)
            seg = self._open_existing(seg_id, path)
            if seg is None:
                counts["bad_segments"] += 1
                log.error("segment %s has no valid header (or another geometry); deleting it",
                          path)
                for p in (path, path[:-4] + ".dead"):
                    try:
                        os.unlink(p)
                    except OSError:
                        pass
                continue
            self.segments[seg_id] = seg
            # to the sealed length, or the segment's end when never sealed
            seg.write_off = merge.add_segment(seg.fd, seg.id, seg.salt, seg.write_off,
                                              self._deaths(seg))
        self.max_version = max(self.max_version, merge.max_version)
        for ns, key, e in merge.live():  # in write order: oldest first
            self.do_link(ns, key, e, self.segments[e.seg])
        for ns, key, e in merge.losers:
            self.do_kill(ns, key, e, indexed=False)
        self.counters["disk_corrupt_dropped"] += counts["corrupt"]
        for seg in self.segments.values():
            if seg.write_off < self.segment_bytes:
                try:  # record the length so the next scan stops there
                    self._write_seg_header(seg, seg.write_off)
                except OSError:
                    pass

    def _load_index(self, raw: bytes, files: list[tuple[int, str]]) -> None:
        idx = decode_index(raw, self.segment_bytes)
        on_disk = dict(files)
        if set(idx.segments) != set(on_disk):
            raise ValueError("segment files differ from the index")
        for sid, (salt, woff) in idx.segments.items():
            self.next_seg_id = max(self.next_seg_id, sid + 1)
            seg = self._open_existing(sid, on_disk[sid])
            if seg is None or seg.salt != salt:
                raise ValueError(f"segment {sid} header does not match the index")
            seg.write_off = woff
            self.segments[sid] = seg
            self._deaths(seg)  # only to find where the next death entry goes
        self.max_version = idx.max_version
        for ns, key, e in idx.live:  # in write order: oldest first
            self.do_link(ns, key, e, self.segments[e.seg])

    def _write_index(self) -> None:
        segs = sorted(self.segments.values(), key=lambda s: s.id)
        write_index_file(self.root, encode_index(
            self.segment_bytes, self.max_version, [(s.id, s.salt, s.write_off) for s in segs],
            self.index.items()))

    # ------------------------------------------------------------------ info / shutdown
    def stats(self) -> dict[str, int]:
        with self.lock:
            return {"disk_capacity_bytes": self.capacity, "disk_used_bytes": self.live_bytes,
                    "disk_allocated_bytes": len(self.segments) * self.segment_bytes,
                    "disk_objects": len(self.index), "disk_segments": len(self.segments),
                    "disk_degraded": int(bool(self.degraded)), "disk_direct_io": int(self.direct),
                    **self.counters}

    def close(self, clean: bool = True) -> None:
        """Seal, sync and (clean) write the index file. Mover thread stopped first."""
        if self._lock_fd < 0:
            return
        self._seal_active()
        if clean and not self.degraded:
            try:
                for s in self.segments.values():
                    os.fsync(s.fd)
                    os.fsync(s.dead_fd)
                self._write_index()
            except OSError as exc:
                log.error("could not write the disk index (%s); the next start scans the "
                          "segments instead", exc)
        with self.lock:
            for s in self.segments.values():
                s.close()
        self._wv.release()
        self._wbuf.close()
        self._hdr_block.close()
        os.close(self._lock_fd)  # releases the flock
        self._lock_fd = -1


def _free_bytes(path: str) -> int | None:
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize

