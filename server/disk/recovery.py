"""Crash recovery of the disk tier: the index file of a clean stop, and the scan after a
crash.

Restart. A clean stop writes ``index`` (entries, segment table, max version,
whole-file CRC) after syncing the segments; start consumes it (``take_index_file``
unlinks it before use, like memcached's restart metadata) so a later crash falls
back to the scan: every segment is read in 1 MiB windows, records are recognised
by magic + salted header CRC (a bad header skips 4 KiB at a time and is
counted), deaths are applied, and for duplicate keys the higher version wins
(``ScanMerge``). Data checksums are verified on each read, never trusted from the
scan.

Both ways give the live records in write order ((segment, offset): oldest first,
which is what the per-namespace disk quota needs). The segment log opens the
segment files and installs what is found (``SegmentLog.do_link``); nothing here
touches its state.

Index file::

    [IDX_HDR: magic, layout, segment_bytes, max_version, nsegs, n]
    [IDX_SEG x nsegs: id, salt, write_off]
    [IDX_ENT + namespace + key (+ placement hash u64 when ``ref`` has IDX_PLACED), x n]
    [crc32 of everything before]

The ``ref`` byte holds the entry's hot bit (1) and IDX_PLACED (2): 8 bytes of the
record's placement hash follow its key. Files written before IDX_PLACED never set it
and decode unchanged.

Threads: startup (the thread that builds the segment log, before any other runs)
and ``close`` (after the mover stopped). All of it blocks on IO.
"""

from __future__ import annotations

import os
import struct
import zlib
from typing import Iterable, NamedTuple

from gcache.server.disk.records import BLOCK, LAYOUT_VERSION, Entry, scan_records

IDX_MAGIC = b"GCINDEX1"
IDX_HDR = struct.Struct("<8sIIQQQQ")  # magic, layout, pad, segment_bytes, max_version, nsegs, n
IDX_SEG = struct.Struct("<QQQ")  # id, salt, write_off
IDX_ENT = struct.Struct("<IIIHHHBBQQQ")  # seg, off4k, rec_pages, hdr_len, ns, key, shift, ref,
#                                         length, version, checksum
IDX_PLACED = 0x2  # in ``ref``: a u64 placement hash follows the key
_PH = struct.Struct("<Q")

Live = tuple[bytes, bytes, Entry]  # (ns, key, entry)


def write_order(live: Iterable[Live]) -> list[Live]:
    """``live`` sorted by where the records sit: the order they were written in."""
    return sorted(live, key=lambda r: (r[2].seg, r[2].off))


# ---------------------------------------------------------------- the index file
class IndexFile(NamedTuple):
    max_version: int
    segments: dict[int, tuple[int, int]]  # id -> (salt, write_off)
    live: list[Live]  # in write order


def encode_index(segment_bytes: int, max_version: int,
                 segments: Iterable[tuple[int, int, int]],
                 entries: Iterable[tuple[tuple[bytes, bytes], Entry]]) -> bytes:
    """The index file of ``segments`` ``(id, salt, write_off)`` and ``entries``."""
    parts = [b""]
    nsegs = n = 0
    for sid, salt, woff in segments:
        parts.append(IDX_SEG.pack(sid, salt, woff))
        nsegs += 1
    for (ns, key), e in entries:
        placed = e.ph is not None
        parts.append(IDX_ENT.pack(e.seg, e.off // BLOCK, e.rec_len // BLOCK, e.hdr_len,
                                  len(ns), len(key), e.chunk_shift,
                                  int(e.ref) | (IDX_PLACED if placed else 0), e.length,
                                  e.version, e.checksum))
        parts.append(ns)
        parts.append(key)
        if placed:
            parts.append(_PH.pack(e.ph))
        n += 1
    parts[0] = IDX_HDR.pack(IDX_MAGIC, LAYOUT_VERSION, 0, segment_bytes, max_version, nsegs, n)
    body = b"".join(parts)
    return body + struct.pack("<I", zlib.crc32(body))


def decode_index(raw: bytes, segment_bytes: int) -> IndexFile:
    """Parse an index file; ValueError (or struct.error) saying why it is unusable."""
    if len(raw) < IDX_HDR.size + 4 or zlib.crc32(raw[:-4]) != struct.unpack("<I", raw[-4:])[0]:
        raise ValueError("CRC mismatch or truncated")
    magic, layout, _p, seg_bytes, max_version, nsegs, n = IDX_HDR.unpack_from(raw, 0)
    if magic != IDX_MAGIC or layout != LAYOUT_VERSION or seg_bytes != segment_bytes:
        raise ValueError("layout or segment size changed")
    pos = IDX_HDR.size
    table = {}
    for _ in range(nsegs):
        sid, salt, woff = IDX_SEG.unpack_from(raw, pos)
        pos += IDX_SEG.size
        table[sid] = (salt, woff)
    live = []
    for _ in range(n):
        (sid, off4k, pages, hdr_len, ns_len, key_len, shift, ref, length, version,
         csum) = IDX_ENT.unpack_from(raw, pos)
        pos += IDX_ENT.size
        ns = raw[pos:pos + ns_len]
        key = raw[pos + ns_len:pos + ns_len + key_len]
        pos += ns_len + key_len
        ph = None
        if ref & IDX_PLACED:
            ph = _PH.unpack_from(raw, pos)[0]
            pos += 8
        if sid not in table:
            raise ValueError(f"entry names unknown segment {sid}")
        live.append((ns, key, Entry(sid, off4k * BLOCK, pages * BLOCK, hdr_len, length,
                                    version, csum, shift, bool(ref & 1), ph)))
    if pos != len(raw) - 4:
        raise ValueError("trailing bytes")
    return IndexFile(max_version, table, write_order(live))


def take_index_file(root: str) -> bytes | None:
    """The index file's bytes, unlinked first (consumed: a later crash must not reuse
    it); None when there is none."""
    path = os.path.join(root, "index")
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        return None
    os.unlink(path)
    return raw


def write_index_file(root: str, body: bytes) -> None:
    """Write the index file durably (temp file, fsync, rename, fsync the directory)."""
    tmp = os.path.join(root, "index.tmp")
    with open(tmp, "wb") as f:
        f.write(body)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(root, "index"))
    dfd = os.open(root, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


# ---------------------------------------------------------------- the scan
class ScanMerge:
    """Folds scanned segments into one index: deaths applied, the higher version wins
    (ties: the later record). ``counts`` gets ``corrupt``, ``dead`` and ``superseded``."""

    def __init__(self, counts: dict[str, int]) -> None:
        self.counts = counts
        self.best: dict[tuple[bytes, bytes], Entry] = {}
        self.losers: list[Live] = []  # superseded copies: their deaths are still to record
        self.max_version = 0

    def add_segment(self, fd: int, seg_id: int, salt: int, end: int,
                    dead: set[tuple[int, int]]) -> int:
        """Scan one segment up to ``end``; returns where its last valid record ends."""
        counts, best = self.counts, self.best
        last = BLOCK
        for off, rec in scan_records(fd, seg_id, salt, end):
            if rec is None:
                counts["corrupt"] += 1
                continue
            e = rec.entry
            last = off + e.rec_len
            self.max_version = max(self.max_version, e.version)
            if (off, e.version) in dead:
                counts["dead"] += 1
                continue
            k = (rec.ns, rec.key)
            old = best.get(k)
            if old is not None:
                counts["superseded"] += 1
                if (old.version, old.seg, old.off) > (e.version, e.seg, e.off):
                    self.losers.append((rec.ns, rec.key, e))
                    continue
                self.losers.append((rec.ns, rec.key, old))
            best[k] = e
        return last

    def live(self) -> list[Live]:
        """The winners, in write order."""
        return write_order((ns, key, e) for (ns, key), e in self.best.items())
