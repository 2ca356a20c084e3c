"""Raw disk baseline for ``gcache-bench --tier disk``: pread the server's own segment files.

gcache-bench prints this next to the disk-tier get numbers of the same run, so
a reader can tell "the disk tier is slow" apart from "this disk is slow".

Design: the bench process finds every record in the server's segment files
(``disk.records.scan_records``: offset, record length, value length), then
``threads`` threads ``preadv`` whole records in a shuffled order into
page-aligned buffers, with ``O_DIRECT`` when the server uses it (so neither
side is served from the page cache). No checksum, no copy, no network: the
best a reader of these exact bytes can do. GB/s counts value bytes, like
gcache-bench does, although each read also moves the record's header and
padding. ``threads`` should match the server's concurrent readers (one per
client connection) for a like-for-like queue depth.
"""

from __future__ import annotations

import mmap
import os
import random
import threading
import time
from typing import Any

from gcache.server.disk.records import read_segment_header, scan_records, segment_paths

__all__ = ["record_extents", "measure_raw_pread"]


def record_extents(root: str) -> list[tuple[str, int, int, int]]:
    """``(path, offset, record bytes, value bytes)`` of every record in a tier directory."""
    out = []
    for _sid, path in segment_paths(root):
        fd = os.open(path, os.O_RDONLY)
        try:
            hdr = read_segment_header(fd)
            if hdr is None:
                continue
            seg_id, salt, seg_bytes, _created, sealed = hdr
            end = sealed or seg_bytes
            for off, rec in scan_records(fd, seg_id, salt, end):
                if rec is not None:
                    out.append((path, off, rec.entry.rec_len, rec.entry.length))
        finally:
            os.close(fd)
    return out


def measure_raw_pread(root: str, *, threads: int = 4, seconds: float = 3.0,
                      direct: bool = True, seed: int = 0) -> dict[str, Any]:
    """Read whole records for ``seconds`` with ``threads`` threads; value GB/s and reads/s."""
    extents = record_extents(root)
    if not extents:
        raise ValueError(f"no records under {root}: nothing to read")
    flags = os.O_RDONLY | (os.O_DIRECT if direct and hasattr(os, "O_DIRECT") else 0)
    fds: dict[str, int] = {}
    try:
        for path, *_ in extents:
            if path not in fds:
                try:
                    fds[path] = os.open(path, flags)
                except OSError:  # O_DIRECT unsupported here: buffered
                    fds[path] = os.open(path, os.O_RDONLY)
                    direct = False
        biggest = max(e[2] for e in extents)
        order = list(range(len(extents)))
        random.Random(seed).shuffle(order)
        barrier = threading.Barrier(threads + 1)
        stop = threading.Event()
        done = [[0, 0] for _ in range(threads)]  # reads, value bytes

        def work(t: int) -> None:
            buf = mmap.mmap(-1, biggest)
            mv = memoryview(buf)
            i = t * len(order) // threads
            barrier.wait()
            while not stop.is_set():
                path, off, rec_len, length = extents[order[i % len(order)]]
                os.preadv(fds[path], [mv[:rec_len]], off)
                done[t][0] += 1
                done[t][1] += length
                i += 1
            mv.release()
            buf.close()

        ts = [threading.Thread(target=work, args=(t,), daemon=True) for t in range(threads)]
        for th in ts:
            th.start()
        barrier.wait()
        t0 = time.perf_counter()
        time.sleep(seconds)
        stop.set()
        for th in ts:
            th.join()
        elapsed = time.perf_counter() - t0
    finally:
        for fd in fds.values():
            os.close(fd)
    reads = sum(d[0] for d in done)
    nbytes = sum(d[1] for d in done)
    return {"threads": threads, "direct_io": direct, "records": len(extents),
            "reads": reads, "seconds": elapsed, "gbps": nbytes / 1e9 / elapsed,
            "reads_per_s": reads / elapsed}
