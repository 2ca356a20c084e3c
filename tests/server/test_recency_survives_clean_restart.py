"""The eviction policy's order survives a restart (issue 14, item 2): the memory tier
saves each object's place in it into its chunk header at a clean stop and every
``recency_snapshot_s`` (on a virtual clock here), and recovery rebuilds it; after a crash
that is the last snapshot's order, then the objects put since, oldest first."""

from __future__ import annotations

import pytest

from gcache.clock import VirtualClock
from gcache.server.arena import Arena
from gcache.server.disk import SegmentLog
from gcache.server.memory_tier import MemoryTier
from gcache.server.tiered_store import TieredStore
from gcache.server.tiering import make_promote_policy
from tierops import put_value

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]

NS = b"ns"
MIB = 1 << 20


def _tier(tmp_path) -> MemoryTier:
    return MemoryTier(Arena(str(tmp_path / "a.arena"), 16 * MIB, MIB, prefault=False))


def _order(m: MemoryTier) -> list[bytes]:
    return [k for _, k in m.keys()]


def test_lru_order_survives_a_clean_restart(tmp_path) -> None:
    m = _tier(tmp_path)
    for k in (b"a", b"b", b"c", b"d"):
        put_value(m, NS, k, 5000)
    m.touch(NS, b"a")
    m.touch(NS, b"c")
    assert _order(m) == [b"b", b"d", b"a", b"c"]
    m.close(clean=True)
    m = _tier(tmp_path)
    try:
        assert _order(m) == [b"b", b"d", b"a", b"c"], "not the order at the stop"
        put_value(m, NS, b"e", 5000)
        m.touch(NS, b"b")
    finally:
        m.close(clean=True)
    m = _tier(tmp_path)
    try:
        assert _order(m) == [b"d", b"a", b"c", b"e", b"b"]
    finally:
        m.close(clean=False)  # a crash: the ranks saved above are an older run's


def test_after_a_crash_the_order_is_the_last_snapshots_then_newer_puts(tmp_path) -> None:
    m = _tier(tmp_path)
    for k in (b"a", b"b", b"c"):
        put_value(m, NS, k, 5000)
    m.close(clean=True)  # ranks a, b, c saved
    m = _tier(tmp_path)
    m.touch(NS, b"a")  # after the last save: lost in the crash below
    put_value(m, NS, b"d", 5000)
    m.close(clean=False)
    m = _tier(tmp_path)
    try:
        assert _order(m) == [b"a", b"b", b"c", b"d"]
    finally:
        m.close()


def test_periodic_snapshot_carries_the_order_across_a_crash(tmp_path) -> None:
    clock = VirtualClock()

    def tier() -> MemoryTier:
        return MemoryTier(Arena(str(tmp_path / "a.arena"), 16 * MIB, MIB, prefault=False),
                          clock=clock.monotonic, recency_snapshot_s=5.0)

    m = tier()
    for k in (b"a", b"b", b"c", b"d"):
        put_value(m, NS, k, 5000)
    m.touch(NS, b"a")
    m.touch(NS, b"b")
    clock.advance(4.9)
    m.step()  # not due yet: nothing saved
    m.close(clean=False)
    m = tier()
    assert _order(m) == [b"a", b"b", b"c", b"d"], "a crash before any snapshot"
    m.touch(NS, b"a")
    m.touch(NS, b"b")
    clock.advance(5.0)
    m.step()  # due: saves c, d, a, b
    m.touch(NS, b"c")  # after the snapshot: lost
    put_value(m, NS, b"e", 5000)  # after the snapshot: after every ranked object
    m.close(clean=False)
    m = tier()
    try:
        assert _order(m) == [b"c", b"d", b"a", b"b", b"e"]
        assert m.recovery["recency_snapshot_age_s"] is not None
        m.touch(NS, b"c")
        clock.advance(5.0)
        m.step()  # a later snapshot's ranks are all above the older ones
        m.close(clean=False)
        m = tier()
        assert _order(m) == [b"d", b"a", b"b", b"e", b"c"]
    finally:
        m.close()


def test_the_tiered_stores_mover_takes_the_snapshots_too(tmp_path) -> None:
    """With a disk tier the memory evictor thread does not run: the mover's step saves."""
    clock = VirtualClock()
    mem = MemoryTier(Arena(str(tmp_path / "a.arena"), 16 * MIB, MIB, prefault=False),
                     clock=clock.monotonic, recency_snapshot_s=5.0)
    disk = SegmentLog(str(tmp_path), "t", capacity_bytes=64 * MIB, segment_bytes=4 * MIB,
                      max_value_bytes=MIB)
    st = TieredStore(mem, disk, make_promote_policy("never", 1000, clock.monotonic),
                     clock=clock.monotonic, room_wait_s=0.0)
    try:
        for k in (b"a", b"b", b"c"):
            put_value(st, NS, k, 5000)
        st.step()
        assert mem.arena.snapshot_record()[0] == 0, "not due yet"
        clock.advance(5.0)
        st.step()
        seq, _, objects, _ = mem.arena.snapshot_record()
        assert (seq, objects) == (1, 3)
    finally:
        st.close()
