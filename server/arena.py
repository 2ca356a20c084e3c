"""The shared-memory arena: file, layout, chunk headers and restart recovery.

Design (memcached's restart.c is the model). The memory tier lives in one file
``{shm_dir}/gcache-{name}.arena`` (mode 0600, or 0640 with ``--shm-group``: clients
only ever map it read-only; flock'ed by its one server),
mmapped MAP_SHARED and prefaulted, so a restarted process finds every object
where it left it. The layout:

    [superblock 4 KiB][page table: u32 per slab page][pad to 4 KiB][slab pages...]

* superblock: magic, layout version, sizes, a ``clean`` flag and the next
  object version. ``clean`` is consumed at start (set to 0) so a later crash
  cannot reuse it, and written 1 only after a clean stop.
* page table: chunk size of each slab page (0 = free). A page is carved into
  equal chunks of one size class; the entry is written before any chunk in it
  is used, so recovery knows where every chunk header sits.
* chunk: ``[header: fixed 64 bytes + namespace + key (+ placement hash), padded to
  64][data]``. The header's ``flags`` holds COMMITTED, written last, after the checksum
  (xxh3_64 of the data) and the header CRC. Freeing clears it first. PLACED, set
  with the uncommitted header and kept by the commit, says 8 bytes (u64 LE) of the
  object's placement hash (the ring position its writer routed it by: its group's, for
  ``group=`` keys) follow the key; the header CRC covers them. An object put without one
  (a static-view client) has no PLACED and no 8 bytes. Arenas written before PLACED
  existed never set it and read unchanged, so it needs no ``LAYOUT_VERSION`` bump.

Recovery scans every carved page with a strided numpy view of the fixed
headers (vectorised magic/commit filter), then verifies the header CRC per
candidate; the data checksum is verified on the object's first read. A
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
from dataclasses import dataclass

import numpy as np

from gcache.errors import ArenaError


log = logging.getLogger("gcache.server.arena")

ARENA_MAGIC = b"GCARENA1"
LAYOUT_VERSION = 1
SUPER = struct.Struct("<8sIIQQIIQQQ")  # magic, layout, fixed_hdr, arena, slab, npages, clean, data_off, next_version, created_ns
SUPER_BYTES = 4096
PAGE_ALIGN = 4096

CHUNK_MAGIC = 0x4F434347  # b"GCCO"
FLAG_COMMITTED = 0x1
FLAG_PLACED = 0x2  # 8 bytes of placement hash follow the key (no layout bump: see above)
# magic u32 | flags u32 | hdr_len u16 | ns_len u16 | key_len u16 | pad u16 |
# version u64 | data_len u64 | checksum u64 | created_ns u64 | hdr_crc u32 | pad u32
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
_CSUM_OFF = 32
_CRC_OFF = 48


def header_len(ns_len: int, key_len: int, placed: bool = False) -> int:
    """Chunk header bytes; ``placed``: with the 8-byte placement hash (FLAG_PLACED)."""
    return (HDR_FIXED + ns_len + key_len + (8 if placed else 0) + 63) & ~63


def size_class(need: int) -> int:
    """Chunk size for ``need`` bytes: 4 KiB granules, at most ~6% waste."""
    align = max(4096, (1 << max(0, (need - 1).bit_length())) >> 4)
    return (need + align - 1) // align * align


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


class Arena:
    """One mmapped arena file. Not thread-safe; the memory tier locks."""

    def __init__(self, path: str, size: int, slab_bytes: int, prefault: bool = True,
                 group: int | None = None) -> None:
        if slab_bytes < 64 * 1024 or slab_bytes % PAGE_ALIGN:
            raise ArenaError(f"slab_bytes {slab_bytes} must be a multiple of 4096 and >= 64KiB")
        npages = (size - SUPER_BYTES) // (slab_bytes + 4)
        data_off = _align(SUPER_BYTES + 4 * npages, PAGE_ALIGN)
        while npages > 0 and data_off + npages * slab_bytes > size:
            npages -= 1
        if npages < 1:
            raise ArenaError(f"memory {size} bytes is smaller than one slab page "
                             f"({slab_bytes} bytes); raise --memory or lower --slab-bytes")
        self.path, self.size, self.slab_bytes = path, size, slab_bytes
        self.npages, self.data_off = npages, data_off
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
                os.close(self.fd)
                raise ArenaError(f"not enough space in {os.path.dirname(path)} for a "
                                 f"{size}-byte arena ({vfs.f_bavail * vfs.f_frsize} free); "
                                 "lower --memory or grow the tmpfs")
            os.ftruncate(self.fd, size)
            if not prefault:  # reserve the pages now so a full tmpfs can't SIGBUS us later
                os.posix_fallocate(self.fd, 0, size)
        self.mm = mmap.mmap(self.fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self.buf = memoryview(self.mm)
        if prefault:
            self._prefault()
        self.page_table = np.frombuffer(self.mm, dtype="<u4", count=npages, offset=SUPER_BYTES)
        if not self.reused:
            self.page_table[:] = 0
            self.next_version = 1
            self._write_super(clean=0, next_version=1, created_ns=time.time_ns())
        else:
            sb = SUPER.unpack_from(self.mm, 0)
            self.was_clean = bool(sb[6])
            self.next_version = sb[8]
            self._write_super(clean=0, next_version=sb[8], created_ns=sb[9])  # consume

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
            _populate_parallel(self.mm, self.size)
            return
        except (OSError, AttributeError, ValueError):
            pass
        try:
            self.mm.madvise(_MADV_POPULATE_WRITE)
        except (OSError, ValueError):
            arr = np.frombuffer(self.mm, dtype=np.uint8)
            int(arr[::4096].sum())  # read-touch fallback

    def page_offset(self, page: int) -> int:
        return self.data_off + page * self.slab_bytes

    def page_of(self, offset: int) -> int:
        return (offset - self.data_off) // self.slab_bytes

    # ------------------------------------------------------------------ chunks
    def write_header(self, off: int, ns: bytes, key: bytes, version: int, length: int,
                     created_ns: int, ph: int | None = None) -> int:
        """Write an uncommitted header (``ph``: the placement hash, FLAG_PLACED); return
        the absolute data offset."""
        placed = ph is not None
        hl = header_len(len(ns), len(key), placed)
        HDR.pack_into(self.mm, off, CHUNK_MAGIC, FLAG_PLACED if placed else 0, hl, len(ns),
                      len(key), 0, version, length, 0, created_ns, 0, 0)
        p = off + HDR_FIXED
        self.mm[p:p + len(ns)] = ns
        p += len(ns)
        self.mm[p:p + len(key)] = key
        if placed:
            _PH.pack_into(self.mm, p + len(key), ph)
        return off + hl

    def commit(self, off: int, csum: int) -> None:
        struct.pack_into("<Q", self.mm, off + _CSUM_OFF, csum)
        crc = self._header_crc(off)
        struct.pack_into("<I", self.mm, off + _CRC_OFF, crc)
        flags = struct.unpack_from("<I", self.mm, off + _FLAGS_OFF)[0] & FLAG_PLACED
        struct.pack_into("<I", self.mm, off + _FLAGS_OFF, flags | FLAG_COMMITTED)  # last

    def clear(self, off: int) -> None:
        struct.pack_into("<II", self.mm, off, 0, 0)

    def _header_crc(self, off: int) -> int:
        """CRC32 of the header past magic and flags: the fixed fields, namespace, key and
        (FLAG_PLACED) the placement hash."""
        flags, hl, ns_len, key_len = struct.unpack_from("<IHHH", self.mm, off + _FLAGS_OFF)
        end = off + HDR_FIXED + ns_len + key_len + (8 if flags & FLAG_PLACED else 0)
        crc = zlib.crc32(self.buf[off + 8:off + _CRC_OFF])
        return zlib.crc32(self.buf[off + HDR_FIXED:end], crc)

    # ------------------------------------------------------------------ recovery
    def scan(self) -> tuple[list[Recovered], dict[str, int]]:
        """Find every valid committed chunk. Returns (objects, counters)."""
        found: dict[tuple[bytes, bytes], Recovered] = {}
        counts = {"torn": 0, "corrupt": 0, "superseded": 0}
        losers: list[Recovered] = []
        for page in np.nonzero(self.page_table)[0]:
            csize = int(self.page_table[page])
            if csize > self.slab_bytes or csize < HDR_FIXED:
                self.page_table[page] = 0
                counts["corrupt"] += 1
                continue
            base = self.page_offset(int(page))
            n = self.slab_bytes // csize
            hdrs = np.ndarray((n,), dtype=HDR_DTYPE, buffer=self.mm, offset=base,
                              strides=(csize,))
            live = (hdrs["magic"] == CHUNK_MAGIC)
            committed = live & ((hdrs["flags"] & FLAG_COMMITTED) != 0)
            counts["torn"] += int((live & ~committed).sum())
            for i in np.nonzero(committed)[0]:
                off = base + int(i) * csize
                rec = self._verify(off, csize)
                if rec is None:
                    counts["corrupt"] += 1
                    self.clear(off)
                    continue
                k = (rec.ns, rec.key)
                old = found.get(k)
                if old is not None:
                    counts["superseded"] += 1
                    if old.version > rec.version:
                        old, rec = rec, old
                    losers.append(old)
                found[k] = rec
        for r in losers:
            self.clear(r.offset)
        return list(found.values()), counts

    def _verify(self, off: int, csize: int) -> Recovered | None:
        """Check a committed header (lengths, header CRC). The data checksum is
        checked by the memory tier on the object's first read, which keeps
        restart time proportional to the number of objects, not their bytes."""
        (_m, flags, hl, ns_len, key_len, _p, version, length, csum, created, crc,
         _p2) = HDR.unpack_from(self.mm, off)
        placed = bool(flags & FLAG_PLACED)
        if hl != header_len(ns_len, key_len, placed) or hl + length > csize:
            return None
        if self._header_crc(off) != crc:
            return None
        data_off = off + hl
        p = off + HDR_FIXED
        ns = bytes(self.buf[p:p + ns_len])
        p += ns_len
        key = bytes(self.buf[p:p + key_len])
        ph = _PH.unpack_from(self.mm, p + key_len)[0] if placed else None
        return Recovered(ns, key, off, csize, data_off, length, version, csum, created, ph)

    # ------------------------------------------------------------------ shutdown
    def close(self, clean: bool, next_version: int) -> None:
        if self.mm.closed:
            return
        sb = SUPER.unpack_from(self.mm, 0)
        self._write_super(clean=1 if clean else 0, next_version=next_version, created_ns=sb[9])
        del self.page_table
        self.buf.release()
        self.mm.close()
        os.close(self.fd)  # releases the flock


_MADV_POPULATE_WRITE = 23


def _populate_parallel(mm: mmap.mmap, size: int) -> None:
    import ctypes
    import threading

    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    anchor = ctypes.c_char.from_buffer(mm)
    base = ctypes.addressof(anchor)
    n = max(1, min(8, os.cpu_count() or 1))
    step = _align(-(-size // n), 1 << 21)
    errors: list[int] = []

    def work(start: int) -> None:
        length = min(step, size - start)
        if length > 0 and libc.madvise(base + start, length, _MADV_POPULATE_WRITE) != 0:
            errors.append(ctypes.get_errno())

    threads = [threading.Thread(target=work, args=(i * step,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    del anchor  # release the buffer export so the mmap can be closed later
    if errors:
        raise OSError(errors[0], os.strerror(errors[0]))


def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def arena_path(shm_dir: str, name: str) -> str:
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in name)
    return os.path.join(shm_dir, f"gcache-{safe}.arena")
