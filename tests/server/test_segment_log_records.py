"""The NVMe tier's segment log in-process: records, reads, rebuild, deaths, compaction, faults."""

from __future__ import annotations

import os

import pytest

from gcache import failpoints
from gcache.server.disk import SegmentLog
from gcache.server.disk.records import BLOCK, REC_HDR, Entry, record_geometry, segment_paths
from gcache.server.movement import DemoteItem
from gcache.server.tiering import SecondChance
from gcache.status import Status
from gcache.testing.oracle import value_for

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

NS = b"ns"
MIB = 1 << 20


@pytest.fixture(autouse=True)
def _no_failpoints():
    failpoints.configure(None)
    yield
    failpoints.configure(None)


def _log(path, **kw) -> SegmentLog:
    kw.setdefault("capacity_bytes", 64 * MIB)
    kw.setdefault("segment_bytes", 4 * MIB)
    kw.setdefault("max_value_bytes", MIB)
    return SegmentLog(str(path), "t", **kw)


def _write(log: SegmentLog, items: list[tuple[bytes, int]], version0: int = 1) -> list[Entry]:
    """Append and publish ``(key, size)`` oracle values; returns the entries."""
    vals = [value_for(k, n) for k, n in items]
    from gcache.hashing import checksum

    res = log.append([DemoteItem(NS, k, version0 + i, memoryview(v), checksum(v), 0)
                      for i, ((k, _n), v) in enumerate(zip(items, vals))])
    assert all(isinstance(r, Entry) for r in res), res
    with log.lock:
        for (k, _n), e in zip(items, res):
            assert log.do_insert(NS, k, e)
    return res


def _get(log: SegmentLog, key: bytes, offset: int = 0, max_len: int = 1 << 40):
    p = log.read(NS, key, offset, max_len, 0)
    try:
        return p.status, (bytes(p.view) if p.view is not None else None)
    finally:
        if p.view is not None:
            p.view.release()
        log.release(p.token)


SIZES = [0, 1, 4096, 70_000, 300_000, 1_000_000]


def test_records_round_trip_whole_and_sliced(tmp_path):
    log = _log(tmp_path)
    items = [(b"k%d" % i, n) for i, n in enumerate(SIZES)]
    _write(log, items)
    for k, n in items:
        assert _get(log, k) == (Status.OK, value_for(k, n))
    big, n = items[-1]
    # a sliced read verifies only the chunks it serves and returns exactly the slice
    for off, ln in [(0, 300_000), (262_144, 262_144), (500_001, 77), (999_999, 10)]:
        assert _get(log, big, off, ln) == (Status.OK, value_for(big, n)[off:off + ln])
    assert _get(log, b"absent")[0] == Status.MISS
    st = log.stats()
    assert st["disk_objects"] == len(items) and st["disk_corrupt_dropped"] == 0
    assert st["disk_used_bytes"] == sum(record_geometry(2, len(k), n)[1] for k, n in items)
    log.close()


def test_records_are_aligned_and_sealed_segments_rebuild_by_scan(tmp_path):
    log = _log(tmp_path)
    items = [(b"s%d" % i, 300_000) for i in range(30)]  # ~9 MB: three 4 MiB segments
    ents = _write(log, items)
    assert all(e.off % BLOCK == 0 and e.rec_len % BLOCK == 0 for e in ents)
    assert len({e.seg for e in ents}) >= 3
    log.close(clean=False)  # no index file: the next start scans
    assert not os.path.exists(os.path.join(log.root, "index"))
    log2 = _log(tmp_path)
    assert log2.recovery["source"] == "scan" and log2.recovery["objects"] == 30
    assert log2.max_version == 30
    for k, n in items:
        assert _get(log2, k) == (Status.OK, value_for(k, n))
    log2.close()


def test_clean_stop_writes_an_index_that_start_consumes(tmp_path):
    log = _log(tmp_path)
    items = [(b"i%d" % i, 70_000) for i in range(20)]
    _write(log, items)
    log.close(clean=True)
    assert os.path.exists(os.path.join(log.root, "index"))
    log2 = _log(tmp_path)
    assert log2.recovery["source"] == "index" and log2.recovery["objects"] == 20
    assert not os.path.exists(os.path.join(log2.root, "index")), "index must be consumed"
    assert all(_get(log2, k) == (Status.OK, value_for(k, n)) for k, n in items)
    log2.close(clean=False)
    log3 = _log(tmp_path)  # crashed after a clean start: scan, same answer
    assert log3.recovery["source"] == "scan" and log3.recovery["objects"] == 20
    log3.close()


def test_deaths_survive_a_crash_so_nothing_is_resurrected(tmp_path):
    log = _log(tmp_path)
    items = [(b"d%d" % i, 5000) for i in range(10)]
    _write(log, items)
    assert log.delete(NS, b"d3")
    with log.lock:  # a newer object now lives in memory: the disk copy dies
        assert log.do_invalidate_below(NS, b"d4", 1000)
        assert not log.do_invalidate_below(NS, b"d5", 1)  # not older: stays
    log.close(clean=False)
    log2 = _log(tmp_path)
    assert log2.recovery["source"] == "scan"
    assert _get(log2, b"d3")[0] == Status.MISS
    assert _get(log2, b"d4")[0] == Status.MISS
    assert _get(log2, b"d5") == (Status.OK, value_for(b"d5", 5000))
    assert log2.recovery["objects"] == 8 and log2.recovery["dead"] == 2
    log2.close()


def test_duplicate_keys_after_a_crash_keep_the_highest_version(tmp_path):
    log = _log(tmp_path)
    _write(log, [(b"dup", 1000)], version0=5)
    # a second copy with a higher version, written but never published (crash before it)
    from gcache.hashing import checksum

    v = value_for(b"dup", 2000)
    assert isinstance(log.append([DemoteItem(NS, b"dup", 9, memoryview(v), checksum(v), 0)])[0], Entry)
    log.close(clean=False)
    log2 = _log(tmp_path)
    assert _get(log2, b"dup") == (Status.OK, v)
    assert log2.recovery["superseded"] == 1
    log2.close()


def _find(root: str, needle: bytes) -> tuple[str, int]:
    for _sid, path in segment_paths(root):
        data = open(path, "rb").read()
        pos = data.find(needle)
        if pos >= 0:
            return path, pos
    raise AssertionError(f"{needle!r} not on disk")


def _flip(path: str, pos: int) -> None:
    with open(path, "r+b") as f:
        f.seek(pos)
        b = f.read(1)
        f.seek(pos)
        f.write(bytes([b[0] ^ 0xFF]))


def test_corrupt_data_byte_is_never_served_and_is_counted(tmp_path):
    log = _log(tmp_path)
    items = [(b"c%d" % i, 300_000) for i in range(4)]
    _write(log, items)
    log.close(clean=True)
    path, pos = _find(log.root, b"nsc2")  # namespace + key sit right after the fixed header
    _flip(path, pos + 200_000)  # inside c2's data
    log2 = _log(tmp_path)
    assert _get(log2, b"c2", 0, 1000)[0] == Status.CORRUPT  # sliced: its chunk is not read,
    assert _get(log2, b"c2")[0] == Status.MISS  # ... but the whole read fails and drops it
    assert log2.stats()["disk_corrupt_dropped"] == 1
    for k, n in items:
        if k != b"c2":
            assert _get(log2, k) == (Status.OK, value_for(k, n))
    log2.close(clean=False)
    assert _log(tmp_path).recovery["objects"] == 3  # the drop was persisted as a death


def test_corrupt_header_is_skipped_by_the_scan_and_counted(tmp_path):
    log = _log(tmp_path)
    items = [(b"h%d" % i, 70_000) for i in range(6)]
    _write(log, items)
    log.close(clean=False)
    path, pos = _find(log.root, b"nsh3")
    _flip(path, pos - 64 + 16)  # h3's version field: the header CRC no longer matches
    log2 = _log(tmp_path)
    assert log2.recovery["corrupt"] == 1 and log2.recovery["objects"] == 5
    assert _get(log2, b"h3")[0] == Status.MISS
    assert _get(log2, b"h4") == (Status.OK, value_for(b"h4", 70_000))  # found past the bad one
    log2.close()


def test_value_shaped_like_a_record_is_not_mistaken_for_one(tmp_path):
    """A stored value holding a copy of a real record (header and all) must never appear as
    an object, even when the scanner walks through that value 4 KiB at a time because the
    value's own header is corrupt: the header CRC is salted with segment and offset."""
    from gcache.hashing import checksum

    log = _log(tmp_path)
    _write(log, [(b"inner", 5000)])
    path, pos = _find(log.root, b"nsinner")
    raw = open(path, "rb").read()[pos - 64:pos - 64 + 3 * BLOCK]
    assert REC_HDR.unpack_from(raw)[0] == 0x44524347
    hdr_len = record_geometry(len(NS), 5, BLOCK + len(raw))[0]
    outer = b"\0" * (BLOCK - hdr_len) + raw  # the copy lands on a 4 KiB boundary
    log.delete(NS, b"inner")
    res = log.append([DemoteItem(NS, b"outer", 7, memoryview(outer), checksum(outer), 0)])
    with log.lock:
        assert log.do_insert(NS, b"outer", res[0])
    log.close(clean=False)
    opath, opos = _find(log.root, b"nsouter")
    _flip(opath, opos - 64 + 16)  # outer's header: the scanner now steps into its data
    log2 = _log(tmp_path)
    assert _get(log2, b"inner")[0] == Status.MISS
    assert _get(log2, b"outer")[0] == Status.MISS
    assert log2.recovery["objects"] == 0 and log2.recovery["corrupt"] == 1
    log2.close()


def test_compaction_carries_hot_records_and_drops_cold_ones(tmp_path):
    log = _log(tmp_path, capacity_bytes=24 * MIB)  # 6 segments of 4 MiB
    first = [(b"a%d" % i, 300_000) for i in range(12)]  # 13 records fit one segment
    _write(log, first)
    rest = [(b"b%d" % i, 300_000) for i in range(44)]  # 56 records: 5 of 6 segments
    _write(log, rest, version0=100)
    assert len(segment_paths(log.root)) == 5 and log.needs_compaction()
    hot = [k for k, _ in first[:4]]
    for k in hot:
        assert log.touch(NS, k)  # touch marks them hot without reading
    res = log.compact_one()  # segment 1 has the fewest live bytes (ties: oldest)
    assert res == {"carried": 4, "dropped": 9, "segment": 1}
    assert not os.path.exists(os.path.join(log.root, "seg-00000001.log"))
    assert not log.needs_compaction()
    for k in hot:
        assert _get(log, k) == (Status.OK, value_for(k, 300_000))
    assert _get(log, b"a9")[0] == Status.MISS
    st = log.stats()
    assert st["disk_evictions"] == 9 and st["disk_carried_over"] == 4
    assert st["disk_compactions"] == 1
    log.close(clean=False)
    log2 = _log(tmp_path, capacity_bytes=24 * MIB)  # the carried copies are the live ones
    assert all(_get(log2, k) == (Status.OK, value_for(k, 300_000)) for k in hot)
    assert log2.recovery["objects"] == 4 + 43
    log2.close()


def test_write_eio_degrades_and_probe_recovers(tmp_path):
    log = _log(tmp_path)
    _write(log, [(b"ok", 1000)])
    failpoints.configure("disk_write=eio:1x")
    from gcache.hashing import checksum

    v = value_for(b"lost", 1000)
    assert log.append([DemoteItem(NS, b"lost", 2, memoryview(v), checksum(v), 0)]) == [Status.NO_SPACE]
    assert log.degraded and "failpoint disk_write" in log.degraded
    assert log.stats()["disk_degraded"] == 1 and log.stats()["disk_write_errors"] == 1
    assert log.append([DemoteItem(NS, b"lost", 2, memoryview(v), checksum(v), 0)]) == [Status.NO_SPACE]
    assert _get(log, b"ok") == (Status.OK, value_for(b"ok", 1000))  # reads keep working
    assert log.probe()  # the failpoint fired its one time: the device is back
    assert log.stats()["disk_degraded"] == 0
    _write(log, [(b"later", 1000)], version0=3)
    assert _get(log, b"later") == (Status.OK, value_for(b"later", 1000))
    log.close()


def test_read_eio_and_injected_corruption_are_dropped_not_served(tmp_path):
    log = _log(tmp_path)
    items = [(b"r%d" % i, 70_000) for i in range(4)]
    _write(log, items)
    failpoints.configure("disk_read=eio:1x,disk_read_corrupt=1:1x")
    assert _get(log, b"r0")[0] == Status.ERROR
    assert _get(log, b"r1")[0] == Status.CORRUPT
    assert _get(log, b"r2") == (Status.OK, value_for(b"r2", 70_000))
    st = log.stats()
    assert st["disk_read_errors"] == 1 and st["disk_corrupt_dropped"] == 1
    assert st["disk_objects"] == 2
    log.close()


def test_geometry_and_directory_faults_are_setup_errors(tmp_path):
    from gcache.server.disk import DiskError

    with pytest.raises(DiskError, match="raise --disk"):
        _log(tmp_path, capacity_bytes=8 * MIB)
    with pytest.raises(DiskError, match="--segment-bytes"):
        _log(tmp_path, max_value_bytes=3 * MIB)
    log = _log(tmp_path)
    with pytest.raises(DiskError, match="in use"):
        _log(tmp_path)
    log.close()


def test_compaction_reclaims_the_segment_its_policy_picks(tmp_path):
    class NewestSealedCarryNothing(SecondChance):
        def victim(self, sealed):
            return max(s.id for s in sealed)

        def carry(self, ns, key, e):
            return False

    log = _log(tmp_path, capacity_bytes=24 * MIB)
    keys = [b"c%d" % i for i in range(56)]  # 13 per segment: 5 segments, the 5th active
    _write(log, [(k, 300_000) for k in keys])
    for k in keys:
        assert log.touch(NS, k)  # all hot: SecondChance would carry them
    res = log.compact_one(NewestSealedCarryNothing())
    assert res == {"carried": 0, "dropped": 13, "segment": 4}
    assert [_get(log, k)[0] for k in keys[39:52]] == [Status.MISS] * 13
    assert all(_get(log, k)[0] == Status.OK for k in keys[:39] + keys[52:])
    log.close(clean=False)
