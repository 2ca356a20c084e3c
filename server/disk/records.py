"""The disk tier's on-disk format: segment files, records, deaths (pure functions).

Files, under ``{disk_dir}/gcache-{name}/`` (one ``LOCK`` file is flock'ed: one
server per directory)::

    seg-00000001.log   [segment header 4 KiB][record][record]...   (posix_fallocate'd)
    seg-00000001.dead  deaths of that segment's records, 16-byte entries (fallocate'd)
    index              the whole index, written on a clean stop, consumed at start
                       (its format: ``recovery``)

Record (4 KiB aligned, never spans segments)::

    [fixed 64 B: magic, flags, hdr_len, ns_len, key_len, nchunks, chunk_shift,
                 version, data_len, xxh3 checksum, created_ns, rec_pages, hdr_crc]
    [namespace][key][pad to 8][placement hash: u64, only with FLAG_PLACED]
    [chunk checksums: u64 x nchunks, only if nchunks > 1][pad to 64][data]
    [zero pad to 4 KiB]

* ``checksum`` is xxh3_64 of the whole data (the memory tier's checksum, so a
  demoted object is checked on the way out of memory and on every read);
  objects over one chunk (>= 256 KiB, <= 256 chunks) also carry one checksum
  per chunk, so a sliced read verifies only the chunks it serves.
* ``hdr_crc`` is a CRC32 over the header, seeded with the segment's random
  salt, id and the record's own offset: a value that happens to contain a
  record-shaped byte string is never mistaken for a record by the scanner.
* ``flags`` bit FLAG_PLACED: the record carries the object's placement hash (the
  ring position its writer routed it by; ``tier.py``), covered by ``hdr_crc``.
  Records written before the flag existed never set it and parse unchanged (no
  ``LAYOUT_VERSION`` bump); an object put without one has neither flag nor bytes.
* Deaths (delete, replace, corrupt, superseded) are appended to the
  segment's ``.dead`` file at once (a small buffered pwrite into preallocated
  space), so a restart after ``kill -9`` never resurrects a deleted or
  replaced object. A segment's deaths vanish with the segment.

Nothing here holds state or a lock: any thread may call it (``pread_into`` and
``pwrite_all`` block on IO; ``build_record`` yields the GIL between copy steps).
"""

from __future__ import annotations

import errno
import mmap
import os
import re
import struct
import time
import zlib
from dataclasses import dataclass
from typing import Iterator

from gcache.hashing import checksum

LAYOUT_VERSION = 1
BLOCK = 4096
SEG_MAGIC = b"GCSEGv01"
# magic, layout, pad, seg id, salt, segment_bytes, created_ns, sealed_len, crc
SEG_HDR = struct.Struct("<8sIIQQQQQI")
REC_MAGIC = 0x44524347  # b"GCRD"
# magic u32 | flags u16 | hdr_len u16 | ns_len u16 | key_len u16 | nchunks u16 |
# chunk_shift u8 | pad u8 | version u64 | data_len u64 | checksum u64 | created_ns u64 |
# rec_pages u32 | pad u32 | hdr_crc u32 | pad u32
REC_HDR = struct.Struct("<IHHHHHBxQQQQIIII")
REC_FIXED = 64
FLAG_PLACED = 0x1  # the placement hash follows the key (see above)
_PH = struct.Struct("<Q")
_CRC_OFF = 56
DEAD = struct.Struct("<IIQ")  # offset / 4 KiB, crc32, version
MIN_CHUNK_SHIFT = 18  # 256 KiB
MAX_CHUNKS = 256
SCAN_WINDOW = 1 << 20
COPY_STEP = 256 << 10  # copy in 256 KiB steps (~50 us each): other threads get the GIL between
ZEROS = bytes(BLOCK)
_SEG_RE = re.compile(r"seg-([0-9]{8})\.log")

def align(n: int, a: int = BLOCK) -> int:
    return (n + a - 1) // a * a


def record_geometry(ns_len: int, key_len: int, length: int, placed: bool = False
                    ) -> tuple[int, int, int, int]:
    """``(hdr_len, rec_len, nchunks, chunk_shift)`` of a record (``placed``: with the
    placement hash)."""
    shift = MIN_CHUNK_SHIFT
    while (length + (1 << shift) - 1) >> shift > MAX_CHUNKS:
        shift += 1
    nchunks = (length + (1 << shift) - 1) >> shift
    hdr_len = align(sums_offset(ns_len, key_len, placed)
                    + (8 * nchunks if nchunks > 1 else 0), 64)
    return hdr_len, align(hdr_len + length), nchunks, shift


def sums_offset(ns_len: int, key_len: int, placed: bool) -> int:
    """Where a record's chunk checksums start (after the placement hash, if any)."""
    return REC_FIXED + align(ns_len + key_len, 8) + (8 if placed else 0)


def _salt_crc(salt: int, seg_id: int, off: int) -> int:
    return zlib.crc32(struct.pack("<QQQ", salt, seg_id, off))


def header_crc(buf: memoryview, hdr_len: int, salt: int, seg_id: int, off: int) -> int:
    crc = zlib.crc32(buf[:_CRC_OFF], _salt_crc(salt, seg_id, off))
    return zlib.crc32(buf[REC_FIXED:hdr_len], crc)


@dataclass(slots=True, eq=False)
class Entry:
    """Where one live record is. ``ref``: read or touched since written (hot)."""

    seg: int
    off: int
    rec_len: int
    hdr_len: int
    length: int
    version: int
    checksum: int
    chunk_shift: int
    ref: bool = False
    ph: int | None = None  # placement hash (FLAG_PLACED), else None


@dataclass(slots=True)
class ScannedRecord:
    ns: bytes
    key: bytes
    entry: Entry
    nchunks: int



def pread_into(fd: int, view: memoryview, off: int) -> None:
    done = 0
    n = len(view)
    while done < n:
        got = os.preadv(fd, [view[done:]], off + done)
        if got <= 0:
            raise OSError(errno.EIO, f"short read at offset {off + done} (end of file)")
        done += got


def pwrite_all(fd: int, view: memoryview, off: int) -> None:
    done = 0
    n = len(view)
    while done < n:
        got = os.pwrite(fd, view[done:], off + done)
        if got <= 0:
            raise OSError(errno.EIO, f"short write at offset {off + done}")
        done += got


def parse_header(buf: memoryview, salt: int, seg_id: int, off: int, limit: int
                 ) -> tuple[bytes, bytes, Entry, int] | None:
    """Validate the record header at ``buf[0:]`` (record at ``off`` in segment ``seg_id``).

    ``limit``: the segment's end (a record may not pass it). Returns
    ``(ns, key, entry, nchunks)`` or None when it is not a valid record header.
    """
    if len(buf) < REC_FIXED:
        return None
    (magic, flags, hdr_len, ns_len, key_len, nchunks, shift, version, length, csum,
     _created, rec_pages, _p, crc, _p2) = REC_HDR.unpack_from(buf, 0)
    if magic != REC_MAGIC:
        return None
    if not MIN_CHUNK_SHIFT <= shift <= 40:
        return None
    placed = bool(flags & FLAG_PLACED)
    geo = record_geometry(ns_len, key_len, length, placed)
    if (hdr_len, rec_pages * BLOCK, nchunks, shift) != geo or off + geo[1] > limit:
        return None
    if len(buf) < hdr_len or header_crc(buf, hdr_len, salt, seg_id, off) != crc:
        return None
    p = REC_FIXED
    ns = bytes(buf[p:p + ns_len])
    key = bytes(buf[p + ns_len:p + ns_len + key_len])
    ph = _PH.unpack_from(buf, REC_FIXED + align(ns_len + key_len, 8))[0] if placed else None
    return ns, key, Entry(seg_id, off, geo[1], hdr_len, length, version, csum, shift,
                          ph=ph), nchunks


def _peek_hdr_len(buf: memoryview) -> int:
    magic, _flags, hdr_len = struct.unpack_from("<IHH", buf, 0)
    return hdr_len if magic == REC_MAGIC else REC_FIXED


def read_segment_header(fd: int) -> tuple[int, int, int, int, int] | None:
    """``(seg_id, salt, segment_bytes, created_ns, sealed_len)``, or None if invalid."""
    mm = mmap.mmap(-1, BLOCK)
    try:
        mv = memoryview(mm)
        try:
            pread_into(fd, mv, 0)
        finally:
            mv.release()
        magic, layout, _p, seg_id, salt, seg_bytes, created, sealed, crc = SEG_HDR.unpack_from(mm)
        if magic != SEG_MAGIC or layout != LAYOUT_VERSION:
            return None
        if zlib.crc32(mm[:SEG_HDR.size - 4]) != crc:
            return None
        return seg_id, salt, seg_bytes, created, sealed
    finally:
        mm.close()


def scan_records(fd: int, seg_id: int, salt: int, end: int
                 ) -> Iterator[tuple[int, ScannedRecord | None]]:
    """Yield ``(offset, record)`` for every valid record header in ``[4 KiB, end)``.

    ``record`` is None for a corrupt stretch (counted once per stretch that sits where
    a record was expected). Reads 1 MiB windows; large records are hopped over.
    """
    win = mmap.mmap(-1, SCAN_WINDOW)
    wv = memoryview(win)
    try:
        w0, w1 = 0, 0  # window covers file bytes [w0, w1)
        pos, expected = BLOCK, BLOCK
        while pos + REC_FIXED <= end:
            if not (w0 <= pos and pos + BLOCK <= w1):
                w0 = pos
                n = min(SCAN_WINDOW, align(end - pos))
                pread_into(fd, wv[:n], pos)
                w1 = pos + n
            hl = _peek_hdr_len(wv[pos - w0:w1 - w0])
            if pos + hl > w1 and w1 < end:  # a long header straddles the window: refill
                w0 = w1 = 0
                continue
            rec = parse_header(wv[pos - w0:w1 - w0], salt, seg_id, pos, end)
            if rec is None:
                if pos == expected and bytes(wv[pos - w0:pos - w0 + REC_FIXED]) != ZEROS[:REC_FIXED]:
                    yield pos, None
                pos += BLOCK
                continue
            ns, key, e, nchunks = rec
            yield pos, ScannedRecord(ns, key, e, nchunks)
            pos += e.rec_len
            expected = pos
    finally:
        wv.release()
        win.close()


def segment_paths(root: str) -> list[tuple[int, str]]:
    """``[(seg_id, path)]`` of the segment files in a tier directory, oldest first."""
    out = []
    for name in os.listdir(root):
        m = _SEG_RE.fullmatch(name)
        if m:
            out.append((int(m[1]), os.path.join(root, name)))
    return sorted(out)


def tier_root(disk_dir: str, name: str) -> str:
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in name)
    return os.path.join(disk_dir, f"gcache-{safe}")



def pack_segment_header(buf: mmap.mmap, seg_id: int, salt: int, segment_bytes: int,
                        created_ns: int, sealed_len: int) -> None:
    """Lay a segment header out in the 4 KiB ``buf`` (``sealed_len`` 0: still open)."""
    buf[:] = ZEROS
    SEG_HDR.pack_into(buf, 0, SEG_MAGIC, LAYOUT_VERSION, 0, seg_id, salt, segment_bytes,
                      created_ns, sealed_len, 0)
    struct.pack_into("<I", buf, SEG_HDR.size - 4, zlib.crc32(buf[:SEG_HDR.size - 4]))


def pack_death(off: int, version: int, salt: int) -> bytes:
    """The ``.dead`` entry of the record at ``off`` with ``version``."""
    off4k = off // BLOCK
    return DEAD.pack(off4k, zlib.crc32(struct.pack("<IQQ", off4k, version, salt)), version)


def parse_deaths(raw: bytes, salt: int) -> tuple[set[tuple[int, int]], int]:
    """``({(offset, version)}, where the next entry goes)`` of a ``.dead`` file."""
    out = set()
    n = nxt = 0
    for off4k, crc, version in DEAD.iter_unpack(raw[:len(raw) // DEAD.size * DEAD.size]):
        n += DEAD.size
        if crc == zlib.crc32(struct.pack("<IQQ", off4k, version, salt)):
            out.add((off4k * BLOCK, version))
            nxt = n
    return out, nxt


def build_record(wv: memoryview, pos: int, salt: int, seg_id: int, off: int, ns: bytes,
                 key: bytes, version: int, data: memoryview, csum: int, created: int,
                 hdr_len: int, rec_len: int, nchunks: int, shift: int,
                 ph: int | None = None) -> bool:
    """Lay one record out at ``wv[pos:]`` (it goes to ``off`` in segment ``seg_id``;
    ``ph``: its placement hash, FLAG_PLACED; the geometry must say so too); False if the
    copied data fails ``csum``."""
    length = len(data)
    d = pos + hdr_len
    for a in range(0, length, COPY_STEP):
        b = min(length, a + COPY_STEP)
        wv[d + a:d + b] = data[a:b]
        time.sleep(0)  # hand the GIL to a waiting serving thread now, not in 5 ms
    if checksum(wv[d:d + length]) != csum:
        return False
    p = pos + REC_FIXED
    wv[p:p + len(ns)] = ns
    wv[p + len(ns):p + len(ns) + len(key)] = key
    q = p + len(ns) + len(key)
    sums_at = pos + sums_offset(len(ns), len(key), ph is not None)
    wv[q:pos + hdr_len] = ZEROS[:pos + hdr_len - q]
    if ph is not None:
        _PH.pack_into(wv, sums_at - 8, ph)
    if nchunks > 1:
        sums = [checksum(wv[d + (c << shift):d + min((c + 1) << shift, length)])
                for c in range(nchunks)]
        struct.pack_into(f"<{nchunks}Q", wv, sums_at, *sums)
    tail = pos + rec_len - (d + length)
    wv[d + length:pos + rec_len] = ZEROS[:tail]
    REC_HDR.pack_into(wv, pos, REC_MAGIC, 0 if ph is None else FLAG_PLACED, hdr_len, len(ns),
                      len(key), nchunks, shift, version, length, csum, created,
                      rec_len // BLOCK, 0, 0, 0)
    crc = header_crc(wv[pos:pos + hdr_len], hdr_len, salt, seg_id, off)
    struct.pack_into("<I", wv, pos + _CRC_OFF, crc)
    return True


def check_fields(mv: memoryview, e: Entry, ns: bytes, key: bytes) -> str:
    """Whole-record read: the header names this object (the data checksum that
    follows covers the bytes served; no header field beyond these is used). "" if so."""
    (magic, _f, hdr_len, ns_len, key_len, _n, _s, version, length, csum, _c, pages, _p,
     _crc, _p2) = REC_HDR.unpack_from(mv, 0)
    if (magic != REC_MAGIC or hdr_len != e.hdr_len or version != e.version
            or length != e.length or csum != e.checksum or pages * BLOCK != e.rec_len
            or ns_len != len(ns) or key_len != len(key)
            or mv[REC_FIXED:REC_FIXED + ns_len] != ns
            or mv[REC_FIXED + ns_len:REC_FIXED + ns_len + key_len] != key):
        return "record header names another object (or is corrupt)"
    return ""
