"""A disk read of an empty range (offset at or past the object's end) gives its segment
reader back: otherwise every such GET pinned the segment for good, and a compacted
segment stayed open (its file's space never came back) however often it was asked."""

from __future__ import annotations

import pytest

from gcache.hashing import checksum
from gcache.server.disk import SegmentLog
from gcache.server.movement import DemoteItem
from gcache.status import Status

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]


def test_empty_range_reads_leave_no_segment_reader(tmp_path):
    log = SegmentLog(str(tmp_path), "e", capacity_bytes=64 << 20, segment_bytes=4 << 20,
                     max_value_bytes=1 << 20)
    try:
        data = memoryview(b"x" * 5000)
        e, = log.append([DemoteItem(b"ns", b"k", 1, data, checksum(data), 0, None)])
        with log.lock:
            assert log.do_insert(b"ns", b"k", e)
        for offset, max_len in ((5000, 10), (9000, 10), (0, 0), (100, 0)):
            p = log.read(b"ns", b"k", offset, max_len, 0)
            assert (p.status, bytes(p.view), p.total_len) == (Status.OK, b"", 5000)
            log.release(p.token)
        assert [s.readers for s in log.segments.values()] == [0] * len(log.segments)
    finally:
        log.close()
