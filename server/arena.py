"""The shared-memory arena: file, layout, chunk headers and restart recovery.

Design (memcached's restart.c is the model). The memory tier lives in one file
``{shm_dir}/gcache-{name}.arena`` (mode 0600, or 0640 with ``--shm-group``: clients
only ever map it read-only; flock'ed by its one server),
mmapped MAP_SHARED and prefaulted, so a restarted process finds every object
where it left it. The layout:

    [superblock 4 KiB][start map: u8 per 4 KiB granule][pad to 4 KiB][data region]

* superblock: magic, layout version, sizes, a ``clean`` flag and the next
  object version. ``clean`` is consumed at start (set to 0) so a later crash
  cannot reuse it, and written 1 only after a clean stop.
* data region: ``npages * slab_bytes`` bytes in 4 KiB granules (``GRANULE``). An object
  is one chunk: a run of whole granules sized to it (``size_class``), anywhere in the
  region (``extents.ExtentAllocator`` keeps the free runs; layout 1 carved equal-chunk
  slab pages per size class, which stranded capacity under mixed sizes). ``slab_bytes``
  now only bounds one chunk (the largest value).
* start map: 1 at the granule where a chunk starts. It is written by the server only,
  after the chunk's uncommitted header (``write_header``), and cleared after the header
  (``clear``), so recovery looks for headers only where the server put one: a value's
  bytes that happen to look like a header are never taken for an object.
* chunk: ``[header: fixed 64 bytes + namespace + key (+ placement hash), padded to
  64][data]``. The header's ``flags`` holds COMMITTED, written last, after the checksum
  (xxh3_64 of the data) and the header CRC. Freeing clears it first. PLACED, set
  with the uncommitted header and kept by the commit, says 8 bytes (u64 LE) of the
  object's placement hash (the ring position its writer routed it by: its group's, for
  ``group=`` keys) follow the key; the header CRC covers them. An object put without one
  (a static-view client) has no PLACED and no 8 bytes. Arenas written before PLACED
  existed never set it and read unchanged, so it needs no ``LAYOUT_VERSION`` bump.
  The chunk's length is not stored: it is ``size_class(header + data length)``.
  The header's last u32 (outside the header CRC) is the object's recency rank
  (``set_rank``): the memory tier writes its eviction policy's order there every
  ``recency_snapshot_s`` and at a clean stop, so recovery (after a crash too) rebuilds
  that order: ascending rank, then rank 0 (objects put since the last snapshot) by
  creation time. A hint only: a wrong rank changes an eviction order, never bytes.
* recency snapshot record: the superblock's bytes after ``SUPER`` (``SNAP``: sequence,
  wall time and object count of the last finished snapshot, and the next rank to hand
  out). Ranks only grow across snapshots and restarts (until the u32 wraps), so a rank
  left from an older snapshot sorts before every newer one; zeros (an arena from before
  this record) read as "no snapshot yet".

Recovery reads the fixed headers at every marked granule with one numpy gather
(vectorised magic/commit filter), then verifies the header CRC per candidate, and
drops a chunk that would overlap one before it or run past the region; every mark
that is not a recovered object is cleared (its granules are free again); the data checksum is verified on the object's first read. A
torn or corrupt chunk is dropped and counted; when
two committed chunks hold the same key (a crash during replace), the higher
version wins. A layout mismatch (version, sizes) means a clean start, logged.
"""

from __future__ import annotations

import fcntl
import logging
import mmap
import os
import struct
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from gcache.errors import ArenaError
from gcache.native import header_commit, header_write


log = logging.getLogger("gcache.server.arena")

ARENA_MAGIC = b"GCARENA1"
LAYOUT_VERSION = 2  # 2: variable chunks anywhere + start map (1: slab pages + page table)
SUPER = struct.Struct("<8sIIQQIIQQQ")  # magic, layout, fixed_hdr, arena, slab, npages, clean, data_off, next_version, created_ns
SUPER_BYTES = 4096
SNAP = struct.Struct("<QQQQ")  # at SUPER.size: seq, wall_ns, objects, next_rank (above)
RANK_MAX = 0xFFFFFFFF
PAGE_ALIGN = 4096
GRANULE = 4096  # allocation unit of the data region; one start-map byte each

CHUNK_MAGIC = 0x4F434347  # b"GCCO"
FLAG_COMMITTED = 0x1
FLAG_PLACED = 0x2  # 8 bytes of placement hash follow the key (no layout bump: see above)
# magic u32 | flags u32 | hdr_len u16 | ns_len u16 | key_len u16 | pad u16 |
# version u64 | data_len u64 | checksum u64 | created_ns u64 | hdr_crc u32 | rank u32
HDR = struct.Struct("<IIHHHHQQQQII")
HDR_FIXED = 64
HDR_DTYPE = np.dtype({
    "names": ["magic", "flags", "hdr_len", "ns_len", "key_len", "version", "data_len"],
    "formats": ["<u4", "<u4", "<u2", "<u2", "<u2", "<u8", "<u8"],
    "offsets": [0, 4, 8, 10, 12, 16, 24],
    "itemsize": HDR_FIXED,
})
_FLAGS_OFF = 4
_PH = struct.Struct("<Q")  # the placement hash after the key (FLAG_PLACED)
_CRC_OFF = 48
_RANK_OFF = 52  # the u32 after hdr_crc, which does not cover it: recency rank (above)


def header_len(ns_len: int, key_len: int, placed: bool = False) -> int:
    """Chunk header bytes; ``placed``: with the 8-byte placement hash (FLAG_PLACED)."""
    return (HDR_FIXED + ns_len + key_len + (8 if placed else 0) + 63) & ~63


def size_class(need: int) -> int:
    """Chunk size for ``need`` bytes: whole 4 KiB granules (less than one wasted)."""
    return (need + GRANULE - 1) // GRANULE * GRANULE


@dataclass(slots=True)
class Recovered:
    ns: bytes
    key: bytes
    offset: int  # chunk offset in the arena
    chunk: int  # chunk size
    data_off: int
    length: int
    version: int
    checksum: int
    created_ns: int
    ph: int | None = None  # the placement hash (FLAG_PLACED), else None
    rank: int = 0  # recency rank from the last snapshot or clean stop (0: none)


class Arena:
    """One mmapped arena file. Not thread-safe; the memory tier locks."""

    def __init__(self, path: str, size: int, slab_bytes: int, prefault: bool = True,
                 group: int | None = None,
                 progress: Callable[[int, int], None] | None = None) -> None:
        """Open or create the arena file. ``progress(done, total)``: called from the
        prefault's threads as it maps the arena (bytes), for the start-up log."""
        self._progress = progress
        if slab_bytes < 64 * 1024 or slab_bytes % PAGE_ALIGN:
            raise ArenaError(f"slab_bytes {slab_bytes} must be a multiple of 4096 and >= 64KiB")
        npages = (size - SUPER_BYTES) // (slab_bytes + slab_bytes // GRANULE)
        data_off = _align(SUPER_BYTES + npages * (slab_bytes // GRANULE), PAGE_ALIGN)
        while npages > 0 and data_off + npages * slab_bytes > size:
            npages -= 1
        if npages < 1:
            raise ArenaError(f"memory {size} bytes is smaller than one slab page "
                             f"({slab_bytes} bytes); raise --memory or lower --slab-bytes")
        self.path, self.size, self.slab_bytes = path, size, slab_bytes
        self.npages, self.data_off = npages, data_off
        self.granules = npages * slab_bytes // GRANULE
        self.created = not os.path.exists(path)  # a failed first start removes it
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(self.fd)
            raise ArenaError(f"arena {path} is in use by another gcache-server; "
                             "give this server a different --name") from None
        st = os.fstat(self.fd)
        if st.st_uid != os.getuid():
            raise ArenaError(f"arena {path} belongs to uid {st.st_uid}, not us; remove it")
        if group is None:
            os.fchmod(self.fd, 0o600)
        else:  # readable by that group (co-located clients of other uids), writable by us
            try:
                os.fchown(self.fd, -1, group)
            except OSError as exc:
                os.close(self.fd)
                raise ArenaError(f"cannot give arena {path} to group {group}: "
                                 f"{exc.strerror}; the server's user must be a member of "
                                 "--shm-group") from None
            os.fchmod(self.fd, 0o640)
        self.reuse_reason = ""
        self.reused = False
        self.was_clean = False
        existing = st.st_size
        if existing == size:
            with open(path, "rb") as f:
                raw = f.read(SUPER.size)
            self.reused, self.reuse_reason = self._check_super(raw)
        elif existing:
            self.reuse_reason = f"arena size changed ({existing} -> {size} bytes)"
        else:
            self.reuse_reason = "no arena file yet"
        if not self.reused:
            os.ftruncate(self.fd, 0)  # drop old pages: a clean start
            vfs = os.statvfs(os.path.dirname(path) or ".")
            if vfs.f_bavail * vfs.f_frsize < size:
                self._abandon()
                raise ArenaError(f"not enough space in {os.path.dirname(path)} for a "
                                 f"{size}-byte arena ({vfs.f_bavail * vfs.f_frsize} free); "
                                 "lower --memory or grow the tmpfs")
            try:
                os.ftruncate(self.fd, size)
                if not prefault:  # reserve the pages now so a full tmpfs can't SIGBUS us
                    os.posix_fallocate(self.fd, 0, size)
            except OSError as exc:
                self._abandon()
                raise ArenaError(f"cannot size the arena {path} to {size} bytes: "
                                 f"{exc.strerror}; lower --memory or grow the tmpfs") from None
        self.mm = mmap.mmap(self.fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self.buf = memoryview(self.mm)
        if prefault:
            self._prefault()
        self.starts = np.frombuffer(self.mm, dtype=np.uint8, count=self.granules,
                                    offset=SUPER_BYTES)
        if not self.reused:
            self.starts[:] = 0
            self.next_version = 1
            self._write_super(clean=0, next_version=1, created_ns=time.time_ns())
        else:
            sb = SUPER.unpack_from(self.mm, 0)
            self.was_clean = bool(sb[6])
            self.next_version = sb[8]
            self._write_super(clean=0, next_version=sb[8], created_ns=sb[9])  # consume

    def _abandon(self) -> None:
        """Undo a failed open: close the file, and remove it if this open created it."""
        os.close(self.fd)
        if self.created:
            try:
                os.unlink(self.path)
            except OSError:
                pass

    # ------------------------------------------------------------------ layout
    def _check_super(self, raw: bytes) -> tuple[bool, str]:
        if len(raw) < SUPER.size:
            return False, "superblock truncated"
        magic, layout, fixed, arena, slab, npages, _clean, data_off, _nv, _c = SUPER.unpack(raw)
        if magic != ARENA_MAGIC:
            return False, "superblock magic missing (not an arena, or never initialised)"
        if layout != LAYOUT_VERSION or fixed != HDR_FIXED:
            return False, f"layout version {layout} != {LAYOUT_VERSION}"
        if (arena, slab, npages, data_off) != (self.size, self.slab_bytes, self.npages,
                                               self.data_off):
            return False, (f"geometry changed (slab {slab} -> {self.slab_bytes}, "
                           f"pages {npages} -> {self.npages})")
        return True, "layout matches"

    def _write_super(self, clean: int, next_version: int, created_ns: int) -> None:
        SUPER.pack_into(self.mm, 0, ARENA_MAGIC, LAYOUT_VERSION, HDR_FIXED, self.size,
                        self.slab_bytes, self.npages, clean, self.data_off, next_version,
                        created_ns)

    def _prefault(self) -> None:
        """Map every page now, so no request pays first-touch faults (~2 GB/s).

        MADV_POPULATE_WRITE (Linux 5.14+) through ctypes, which drops the GIL, in
        one thread per core: page-table population scales with cores. Falls back to
        a single-threaded madvise, then to touching one byte per page.
        """
        try:
            _populate_parallel(self.mm, self.size, self._progress)
            return
        except (OSError, AttributeError, ValueError):
            pass
        try:
            self.mm.madvise(_MADV_POPULATE_WRITE)
        except (OSError, ValueError):
            arr = np.frombuffer(self.mm, dtype=np.uint8)
            int(arr[::4096].sum())  # read-touch fallback

    def granule_offset(self, granule: int) -> int:
        return self.data_off + granule * GRANULE

    def granule_of(self, offset: int) -> int:
        return (offset - self.data_off) // GRANULE

    # ------------------------------------------------------------------ chunks
    def write_header(self, off: int, ns: bytes, key: bytes, version: int, length: int,
                     created_ns: int, ph: int | None = None) -> int:
        """Write an uncommitted header (``ph``: the placement hash, FLAG_PLACED), then mark
        the chunk's start in the start map; return the absolute data offset."""
        # the header, then its start mark (see above); native.header_write, ~0.2 us in C
        return header_write(self.mm, off, ns, key, version, length, created_ns, ph,
                            SUPER_BYTES + (off - self.data_off) // GRANULE)

    def commit(self, off: int, csum: int) -> None:
        """Store the value's checksum and the header's CRC, then FLAG_COMMITTED, last."""
        header_commit(self.mm, off, csum)

    def set_rank(self, off: int, rank: int) -> None:
        """Write the chunk's recency rank (a u32 outside the header CRC)."""
        struct.pack_into("<I", self.mm, off + _RANK_OFF, rank)

    def snapshot_record(self) -> tuple[int, int, int, int]:
        """The last finished recency snapshot: ``(seq, wall_ns, objects, next_rank)``;
        all 0 when there was none."""
        return SNAP.unpack_from(self.mm, SUPER.size)

    def write_snapshot_record(self, seq: int, wall_ns: int, objects: int,
                              next_rank: int) -> None:
        SNAP.pack_into(self.mm, SUPER.size, seq, wall_ns, objects, next_rank)

    def rank(self, off: int) -> int:
        return struct.unpack_from("<I", self.mm, off + _RANK_OFF)[0]

    def clear(self, off: int) -> None:
        """Free the chunk at ``off``: header first, then its start mark."""
        struct.pack_into("<II", self.mm, off, 0, 0)
        self.starts[(off - self.data_off) // GRANULE] = 0

    def _header_crc(self, off: int) -> int:
        """CRC32 of the header past magic and flags: the fixed fields, namespace, key and
        (FLAG_PLACED) the placement hash."""
        flags, hl, ns_len, key_len = struct.unpack_from("<IHHH", self.mm, off + _FLAGS_OFF)
        end = off + HDR_FIXED + ns_len + key_len + (8 if flags & FLAG_PLACED else 0)
        crc = zlib.crc32(self.buf[off + 8:off + _CRC_OFF])
        return zlib.crc32(self.buf[off + HDR_FIXED:end], crc)

    # ------------------------------------------------------------------ recovery
    def scan(self, progress: Callable[[int, int], None] | None = None
             ) -> tuple[list[Recovered], dict[str, int]]:
        """Find every valid committed chunk. Returns (objects, counters).
        ``progress(done, total)``: chunks checked so far, every 4096, for the start-up log."""
        found: dict[tuple[bytes, bytes], Recovered] = {}
        counts = {"torn": 0, "corrupt": 0, "superseded": 0}
        marked = np.nonzero(self.starts)[0]
        if not len(marked):
            return [], counts
        every = np.ndarray((self.granules,), dtype=HDR_DTYPE, buffer=self.mm,
                           offset=self.data_off, strides=(GRANULE,))
        hdrs = every[marked]  # one gather of the fixed headers at the marks
        live = hdrs["magic"] == CHUNK_MAGIC
        committed = live & ((hdrs["flags"] & FLAG_COMMITTED) != 0)
        counts["torn"] = int((live & ~committed).sum())
        self.starts[marked[~committed]] = 0  # torn or freed mid-way: free granules
        end = self.data_off + self.granules * GRANULE
        taken_to = self.data_off  # chunks come in address order: none may overlap
        losers: list[Recovered] = []
        todo = marked[committed]
        for i, g in enumerate(todo):
            if progress is not None and not i & 4095:
                progress(i, len(todo))
            off = self.data_off + int(g) * GRANULE
            rec = self._verify(off, end - off) if off >= taken_to else None
            if rec is None:
                counts["corrupt"] += 1
                self.starts[g] = 0  # never write there: it may be another chunk's data
                continue
            taken_to = off + rec.chunk
            k = (rec.ns, rec.key)
            old = found.get(k)
            if old is not None:
                counts["superseded"] += 1
                if old.version > rec.version:
                    old, rec = rec, old
                losers.append(old)
            found[k] = rec
        if progress is not None:
            progress(len(todo), len(todo))
        for r in losers:
            self.clear(r.offset)
        return list(found.values()), counts

    def _verify(self, off: int, room: int) -> Recovered | None:
        """Check a committed header (lengths, within ``room`` bytes, header CRC). The
        data checksum is
        checked by the memory tier on the object's first read, which keeps
        restart time proportional to the number of objects, not their bytes."""
        (_m, flags, hl, ns_len, key_len, _p, version, length, csum, created, crc,
         _p2) = HDR.unpack_from(self.mm, off)
        placed = bool(flags & FLAG_PLACED)
        csize = size_class(hl + length)
        if hl != header_len(ns_len, key_len, placed) or csize > min(room, self.slab_bytes):
            return None
        if self._header_crc(off) != crc:
            return None
        data_off = off + hl
        p = off + HDR_FIXED
        ns = bytes(self.buf[p:p + ns_len])
        p += ns_len
        key = bytes(self.buf[p:p + key_len])
        ph = _PH.unpack_from(self.mm, p + key_len)[0] if placed else None
        rank = struct.unpack_from("<I", self.mm, off + _RANK_OFF)[0]
        return Recovered(ns, key, off, csize, data_off, length, version, csum, created, ph,
                         rank)

    # ------------------------------------------------------------------ shutdown
    def close(self, clean: bool, next_version: int) -> None:
        if self.mm.closed:
            return
        sb = SUPER.unpack_from(self.mm, 0)
        self._write_super(clean=1 if clean else 0, next_version=next_version, created_ns=sb[9])
        del self.starts
        self.buf.release()
        self.mm.close()
        os.close(self.fd)  # releases the flock


_MADV_POPULATE_WRITE = 23


_POPULATE_CHUNK = 256 << 20  # one madvise call: small enough to report progress often


def _populate_parallel(mm: mmap.mmap, size: int,
                       progress: Callable[[int, int], None] | None = None) -> None:
    """MADV_POPULATE_WRITE over the mapping, 256 MiB at a time, by one thread per core
    (up to 8) taking the next chunk; ``progress(bytes done, size)`` after each chunk."""
    import ctypes
    import itertools
    import threading

    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    anchor = ctypes.c_char.from_buffer(mm)
    base = ctypes.addressof(anchor)
    n = max(1, min(8, os.cpu_count() or 1))
    chunks = itertools.count()  # next() is atomic under the GIL
    errors: list[int] = []
    lock = threading.Lock()
    done = [0]

    def work() -> None:
        while not errors:
            start = next(chunks) * _POPULATE_CHUNK
            length = min(_POPULATE_CHUNK, size - start)
            if length <= 0:
                return
            if libc.madvise(base + start, length, _MADV_POPULATE_WRITE) != 0:
                errors.append(ctypes.get_errno())
                return
            if progress is not None:
                with lock:
                    done[0] += length
                    progress(done[0], size)

    threads = [threading.Thread(target=work, name="gcache-prefault") for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    del anchor  # release the buffer export so the mmap can be closed later
    if errors:
        raise OSError(errors[0], os.strerror(errors[0]))


def arena_bytes_for(npages: int, slab_bytes: int) -> int:
    """The ``--memory`` that gives an arena of exactly ``npages`` pages of ``slab_bytes``
    (``npages * slab_bytes`` of data): superblock, start map, padding, data region."""
    return _align(SUPER_BYTES + npages * (slab_bytes // GRANULE), PAGE_ALIGN) + npages * slab_bytes


def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def arena_path(shm_dir: str, name: str) -> str:
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in name)
    return os.path.join(shm_dir, f"gcache-{safe}.arena")
