"""``SegmentLog.read_many``: a group of disk reads, issued and checksummed in one native
call, answers item by item exactly as ``read`` would.

One group mixes whole reads, a part of a small record (read whole, served sliced), a
slice of a chunked record and an empty range (both handed to ``read``), a miss, a
version conflict, a record corrupted on the device itself and a read the device fails.
Each item gets its own status and its own bytes, the broken records are dropped and
counted, hits and served bytes are counted once, every segment reader and buffer comes
back, a segment retired while a group reads it is closed when that group ends, and a
failure in an item read the slow way gives back the pins the group already took."""

from __future__ import annotations

import os
import threading

import pytest

from gcache import failpoints
from gcache.server.disk import SegmentLog
from gcache.server.movement import DemoteItem
from gcache.hashing import checksum
from gcache.status import Status
from gcache.testing.oracle import value_for
from gcache.testing.waiting import wait_for

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

NS = b"ns"
SMALL = 100_000
BIG = 700_000  # three 256 KiB chunks


@pytest.fixture
def log(tmp_path):
    failpoints.configure(None)
    disk = SegmentLog(str(tmp_path), "g", capacity_bytes=64 << 20, segment_bytes=4 << 20,
                      max_value_bytes=1 << 20)
    yield disk
    failpoints.configure(None)
    disk.close()


def write(disk: SegmentLog, keys: dict[bytes, int]) -> dict[bytes, int]:
    items, versions = [], {}
    for n, (k, size) in enumerate(keys.items(), start=1):
        data = memoryview(value_for(k, size))
        items.append(DemoteItem(NS, k, n, data, checksum(data), 0, None))
        versions[k] = n
    entries = disk.append(items)
    for (k, _s), e in zip(keys.items(), entries):
        assert not isinstance(e, Status), e
        with disk.lock:
            assert disk.do_insert(NS, k, e)
    return versions


def corrupt_on_device(disk: SegmentLog, key: bytes) -> None:
    e = disk.index[(NS, key)]
    with open(disk.segments[e.seg].path, "r+b") as f:
        at = e.off + e.hdr_len + e.length // 2
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0x5A]))
        f.flush()
        os.fsync(f.fileno())


def release_all(disk: SegmentLog, pins) -> None:
    for p in pins:
        if p.view is not None:
            p.view.release()
        disk.release(p.token)


def test_one_group_answers_each_item_as_read_would(log):
    keys = {b"a": SMALL, b"b": SMALL, b"c": SMALL, b"big": BIG, b"rot": SMALL,
            b"e": SMALL}
    v = write(log, keys)
    corrupt_on_device(log, b"rot")
    before = dict(log.counters)
    items = [(b"a", 0, 1 << 40, 0), (b"nope", 0, 1 << 40, 0), (b"b", 1000, 500, 0),
             (b"big", 300_000, 100_000, 0), (b"c", 0, 1 << 40, v[b"c"] + 7),
             (b"rot", 0, 1 << 40, 0), (b"e", SMALL, 10, 0), (b"c", 0, 1 << 40, v[b"c"])]
    pins = log.read_many(NS, items)
    try:
        assert [p.status for p in pins] == [Status.OK, Status.MISS, Status.OK, Status.OK,
                                            Status.CONFLICT, Status.CORRUPT, Status.OK,
                                            Status.OK]
        assert bytes(pins[0].view) == value_for(b"a", SMALL)
        assert bytes(pins[2].view) == value_for(b"b", SMALL)[1000:1500]
        assert bytes(pins[3].view) == value_for(b"big", BIG)[300_000:400_000]
        assert (pins[4].total_len, pins[4].version) == (SMALL, v[b"c"])
        assert bytes(pins[6].view) == b"" and pins[6].total_len == SMALL
        assert bytes(pins[7].view) == value_for(b"c", SMALL)
        for p, k in ((pins[0], b"a"), (pins[7], b"c")):  # promotion gets the whole object
            assert p.token.whole is not None and bytes(p.token.whole) == value_for(k, SMALL)
            assert (p.checksum, p.version) == (checksum(value_for(k, SMALL)), v[k])
        assert pins[2].token.first is False and pins[0].token.first is True
    finally:
        release_all(log, pins)
    c = log.counters
    assert c["disk_corrupt_dropped"] - before["disk_corrupt_dropped"] == 1
    assert c["disk_hits"] - before["disk_hits"] == 3  # a, rot, c: the reads from offset 0
    assert c["disk_read_bytes"] - before["disk_read_bytes"] == SMALL + 500 + 100_000 + SMALL
    assert not log.exists(NS, b"rot")  # dropped, never served
    assert [s.readers for s in log.segments.values()] == [0] * len(log.segments)
    again = log.read_many(NS, [(b"rot", 0, 1 << 40, 0), (b"a", 0, 1 << 40, 0)])
    assert [p.status for p in again] == [Status.MISS, Status.OK]
    release_all(log, again)


def test_a_failed_read_in_a_group_is_that_items_error_and_the_rest_are_served(log):
    keys = {k: SMALL for k in (b"a", b"b", b"c", b"d")}
    write(log, keys)
    failpoints.configure("disk_read=eio:1x")  # the group's first read fails, once
    pins = log.read_many(NS, [(k, 0, 1 << 40, 0) for k in keys])
    try:
        assert [p.status for p in pins] == [Status.ERROR] + [Status.OK] * 3
        assert [bytes(p.view) for p in pins[1:]] == [value_for(k, SMALL) for k in (b"b", b"c", b"d")]
    finally:
        release_all(log, pins)
    assert log.counters["disk_read_errors"] == 1 and not log.exists(NS, b"a")
    assert all(s.readers == 0 for s in log.segments.values())


def test_a_segment_retired_under_a_group_closes_when_the_group_ends(log):
    write(log, {b"a": SMALL, b"b": SMALL, **{b"f%d" % i: SMALL for i in range(50)}})
    seg = log.segments[log.index[(NS, b"a")].seg]
    assert log.index[(NS, b"f49")].seg != seg.id  # a and b's segment is sealed
    failpoints.configure("disk_read_slow=1x")  # the group waits before its reads
    out: list = []
    t = threading.Thread(target=lambda: out.append(
        log.read_many(NS, [(b"a", 0, 1 << 40, 0), (b"b", 0, 1 << 40, 0)])))
    t.start()
    assert wait_for(lambda: seg.readers == 2, timeout=5)
    with log.lock:  # what compaction does to a reclaimed segment
        for k in list(seg.keys):
            e = log.index.get(k)
            if e is not None and e.seg == seg.id:
                log.do_unlink(k[0], k[1], e, seg)
        del log.segments[seg.id]
        seg.retired = True
        if seg.readers == 0:
            seg.close()
    assert seg.fd >= 0  # the group's readers keep it open
    t.join(timeout=10)
    assert not t.is_alive()
    pins = out[0]
    assert seg.readers == 0 and seg.fd == -1  # closed by the group, once its reads ended
    assert [p.status for p in pins] == [Status.OK, Status.OK]
    assert [bytes(p.view) for p in pins] == [value_for(b"a", SMALL), value_for(b"b", SMALL)]
    release_all(log, pins)


def test_an_exception_in_a_sliced_read_gives_back_the_groups_pins(log, monkeypatch):
    write(log, {b"a": SMALL, b"b": SMALL, b"big": BIG})

    def broken(*_a, **_k):
        raise RuntimeError("a bug in the sliced path")

    monkeypatch.setattr(log, "read", broken)  # only the sliced item goes through read
    idle = log.pool.idle
    with pytest.raises(RuntimeError):
        log.read_many(NS, [(b"a", 0, 1 << 40, 0), (b"big", 300_000, 1000, 0),
                           (b"b", 0, 1 << 40, 0)])
    assert log.pool.idle >= idle + 2 * log.pool.bucket(SMALL)  # a's and b's buffers back
    assert [s.readers for s in log.segments.values()] == [0] * len(log.segments)
