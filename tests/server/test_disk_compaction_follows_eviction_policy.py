"""The disk tier's compaction and quota evictions give records up in the configured
eviction policy's order (issue 14, item 1: policies apply to "the disk tier's compaction
victims"), and demotion takes the memory policy's first candidates; in-process, the
mover stepped by hand on a virtual clock.

Each 4 MiB segment holds 20 records of 200 KB: S1 = a0..a19, S2 = b0..b19, and a few
c records in the active segment."""

from __future__ import annotations

import pytest

from gcache.clock import VirtualClock
from gcache.hashing import checksum
from gcache.server.arena import Arena
from gcache.server.disk import SegmentLog
from gcache.server.disk.records import Entry
from gcache.server.eviction import make_policy
from gcache.server.memory_tier import MemoryTier
from gcache.server.movement import DemoteItem
from gcache.server.tiered_store import TieredStore
from gcache.server.tiering import PolicyOrder, make_promote_policy
from gcache.status import Status
from gcache.testing.oracle import value_for
from tierops import put_value, read_value

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

NS = b"ns"
MIB = 1 << 20
SIZE = 200_000
A = [b"a%d" % i for i in range(20)]
B = [b"b%d" % i for i in range(20)]
C = [b"c%d" % i for i in range(3)]


def _log(tmp_path, policy: str | None) -> SegmentLog:
    return SegmentLog(str(tmp_path), "t", capacity_bytes=64 * MIB, segment_bytes=4 * MIB,
                      max_value_bytes=MIB,
                      eviction_policy=make_policy(policy) if policy else None)


def _write(log: SegmentLog, keys: list[bytes]) -> None:
    vals = [value_for(k, SIZE) for k in keys]
    res = log.append([DemoteItem(NS, k, 1, memoryview(v), checksum(v), 0)
                      for k, v in zip(keys, vals)])
    assert all(isinstance(r, Entry) for r in res), res
    with log.lock:
        for k, e in zip(keys, res):
            assert log.do_insert(NS, k, e)


def _read(log: SegmentLog, key: bytes) -> None:
    p = log.read(NS, key, 0, 1 << 40, 0)
    assert p.status == Status.OK
    p.view.release()
    log.release(p.token)


def _segments(log: SegmentLog, *groups: list[bytes]) -> None:
    for g in groups:  # each group is one segment's records
        _write(log, g)
    segs = {log.index[(NS, g[0])].seg for g in groups}
    assert len(segs) == len(groups), "the records must fill one segment per group"


def _here(log: SegmentLog, keys: list[bytes]) -> list[bytes]:
    return [k for k in keys if log.exists(NS, k)]


def test_lru_compaction_drops_the_oldest_records_not_the_emptiest_segments(tmp_path) -> None:
    log = _log(tmp_path, "lru")
    try:
        _segments(log, A, B, C)
        for k in B[5:]:  # S2 is mostly dead: the emptiest segment, yet its records are newer
            assert log.delete(NS, k)
        r = log.compact_one(PolicyOrder())
        assert r["dropped"] == 20 and r["carried"] == 0, r
        assert _here(log, A) == [] and _here(log, B) == B[:5] and _here(log, C) == C
    finally:
        log.close()
    # the same with the ref-bit rule (no policy): the emptiest segment, newer records lost
    log = _log(tmp_path / "sc", None)
    try:
        _segments(log, A, B, C)
        for k in B[5:]:
            assert log.delete(NS, k)
        r = log.compact_one(PolicyOrder())  # falls back to SecondChance without a policy
        assert r["dropped"] == 5 and _here(log, A) == A and _here(log, B) == []
    finally:
        log.close()


@pytest.mark.parametrize("policy, keeps_read", [("lru", False), ("reuse", True),
                                                ("s3fifo", True)])
def test_compaction_victims_follow_the_configured_policy(tmp_path, policy: str,
                                                         keeps_read: bool) -> None:
    log = _log(tmp_path, policy)
    try:
        _write(log, A)
        for k in A[:10]:  # read once, before the b records came
            _read(log, k)
        _write(log, B)
        _write(log, C)
        r = log.compact_one(PolicyOrder())
        assert r["dropped"] > 5, r
        gone = [k for k in A + B if not log.exists(NS, k)]
        if keeps_read:  # read records outlive every never-read one: the b's go first
            assert _here(log, A) == A
            assert gone == B[:len(gone)], gone
        else:  # LRU: the a records are the least recently used, read or not
            assert gone == A, gone
        assert _here(log, C) == C
    finally:
        log.close()


def test_quota_eviction_kills_the_namespaces_first_candidate(tmp_path) -> None:
    log = _log(tmp_path, "lru")
    try:
        _write(log, A[:4])
        _read(log, A[0])
        killed, fits = log.fit_quota(NS, 3 * log.index[(NS, A[0])].rec_len, 0)
        assert (killed, fits) == (1, True)
        assert _here(log, A[:4]) == [A[0], A[2], A[3]], "the least recently used one goes"
    finally:
        log.close()


@pytest.mark.parametrize("policy", ["reuse", "lru"])
def test_tiered_store_demotes_and_compacts_in_policy_order(tmp_path, policy: str) -> None:
    """Through the mover on a virtual clock, the same policy in both tiers: objects read
    once before 30 others came are demoted after those under ``reuse``, before them under
    LRU; then the disk fills and compacts in its policy's order, every value intact."""
    clock = VirtualClock()
    arena = Arena(str(tmp_path / "t.arena"), 8 * MIB, MIB, prefault=False)
    mem = MemoryTier(arena, high_watermark=0.8, low_watermark=0.5, clock=clock.monotonic,
                     eviction_policy=make_policy(policy))
    disk = SegmentLog(str(tmp_path), "t", capacity_bytes=16 * MIB, segment_bytes=4 * MIB,
                      max_value_bytes=MIB, eviction_policy=make_policy(policy))
    st = TieredStore(mem, disk, make_promote_policy("never", 1000, clock.monotonic),
                     clock=clock.monotonic, room_wait_s=0.0, compaction=PolicyOrder())
    try:
        hot = [b"hot%d" % i for i in range(5)]
        for k in hot:
            put_value(st, NS, k, SIZE)
            assert read_value(st, NS, k) is not None  # read once: a reuse
        for i in range(30):  # demotion starts at 80 % of memory (~28 objects)
            put_value(st, NS, b"w%d" % i, SIZE)
            clock.advance(0.01)
            st.step()
        assert st.stats()["demoted"] > 5
        in_memory = [mem.exists(NS, k) for k in hot]
        assert in_memory == [policy == "reuse"] * 5, in_memory
        for i in range(30, 130):  # 20 MB more through 8 MiB of memory and 16 MiB of disk
            put_value(st, NS, b"w%d" % i, SIZE)
            clock.advance(0.01)
            st.step()
        s = st.stats()
        assert s["disk_compactions"] > 0 and s["disk_evictions"] > 0, s
        here = [k for k in hot + [b"w%d" % i for i in range(130)] if st.exists(NS, k)]
        assert all(read_value(st, NS, k) == value_for(k, SIZE) for k in here)
        assert all(st.exists(NS, k) for k in hot) == (policy == "reuse")
    finally:
        st.close()


def test_carried_records_keep_their_place_in_the_policy(tmp_path) -> None:
    """A rewrite by compaction is neither a use nor a new key: under ``reuse`` a carried
    never-read record stays in the never-read class (its ghost must not promote it)."""
    log = _log(tmp_path, "reuse")
    try:
        _segments(log, A, B, C)
        for k in A[:10]:
            _read(log, k)
        r = log.compact_one(PolicyOrder())
        carried = [k for k in B if log.exists(NS, k)]
        assert r["carried"] == len(carried) > 0 and _here(log, A) == A, r
        with log.lock:
            order = [o.key for o in log.policy.candidates()]
        assert max(order.index(k) for k in carried) < min(order.index(k) for k in A[:10])
    finally:
        log.close()
