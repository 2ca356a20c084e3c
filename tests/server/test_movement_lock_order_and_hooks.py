"""The movement contract in code: each tier has every member its protocol names, the
memory tier's lock comes before the disk's (a take against that order raises, with the
lock_order failpoint on), a whole mover workload of demotion, promotion, replace, delete
and compaction keeps that order, and a memory tier's hooks are given once."""

from __future__ import annotations

import threading

import pytest

from gcache import failpoints
from gcache.errors import WiringError
from gcache.server.arena import Arena
from gcache.server.memory_tier import MemoryTier
from gcache.server.movement import DiskSide, LockRank, MemorySide, ranked_lock
from gcache.server.disk import SegmentLog
from gcache.server.tiered_store import TieredStore
from gcache.server.tiering import make_promote_policy
from gcache.testing.oracle import value_for
from tierops import put_value, read_value

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

NS = b"ns"
MIB = 1 << 20
SIZE = 200_000


@pytest.fixture(autouse=True)
def _lock_order_checked():
    failpoints.configure("lock_order")
    yield
    failpoints.configure(None)


def _open(tmp_path) -> TieredStore:
    arena = Arena(str(tmp_path / "a.arena"), 8 * MIB, MIB, prefault=False)
    mem = MemoryTier(arena, high_watermark=0.8, low_watermark=0.5)
    disk = SegmentLog(str(tmp_path), "t", capacity_bytes=16 * MIB, segment_bytes=4 * MIB,
                      max_value_bytes=MIB)
    return TieredStore(mem, disk, make_promote_policy("first", 1000), room_wait_s=0.0)


def _put(st: TieredStore, key: bytes, n: int = SIZE) -> None:
    put_value(st, NS, key, n)


def _get(st: TieredStore, key: bytes) -> bytes | None:
    return read_value(st, NS, key)


def test_each_side_has_every_member_its_protocol_names(tmp_path) -> None:
    st = _open(tmp_path)
    try:
        for side, proto in ((st.memory, MemorySide), (st.disk, DiskSide)):
            names = {n for n in vars(proto) if not n.startswith("_")}
            names |= set(proto.__annotations__)
            assert len(names) > 15
            missing = sorted(n for n in names if not hasattr(side, n))
            assert not missing, f"{type(side).__name__} lacks {missing}"
    finally:
        st.close()


def test_a_take_against_the_order_raises() -> None:
    memory, disk = ranked_lock(LockRank.MEMORY), ranked_lock(LockRank.DISK)
    with memory, disk:  # the documented order
        pass
    with disk:
        with pytest.raises(WiringError, match="MEMORY -> DISK"):
            memory.acquire()
    assert memory.acquire(blocking=False)  # nothing leaked: both are free again
    memory.release()
    failpoints.configure(None)
    assert type(ranked_lock(LockRank.MEMORY)) is type(threading.Lock())  # no cost when off


def test_mover_workload_keeps_the_lock_order(tmp_path) -> None:
    st = _open(tmp_path)
    try:
        assert failpoints.fired("lock_order") == 2, "both tiers' locks are ranked"
        keys = [b"k%d" % i for i in range(90)]  # 18 MB through 7 MiB of memory, 16 of disk
        for k in keys:
            _put(st, k)
            st.step()  # demotion (and compaction once the disk fills)
        assert st.stats()["demoted"] > 0 and st.stats()["disk_compactions"] > 0
        live = [k for k in keys if st.exists(NS, k)]
        for k in live[:10]:
            assert _get(st, k) == value_for(k, SIZE)  # disk hits promote on unpin
        st.step()
        assert st.stats()["promoted"] > 0
        _put(st, live[0], 5000)  # a replace kills the older disk copy under both locks
        assert st.delete(NS, live[1]) and not st.exists(NS, live[1])
        assert st.touch(NS, live[2])
        st.step()
        assert _get(st, live[0]) == value_for(live[0], 5000)
    finally:
        st.close()


def test_hooks_are_given_once(tmp_path) -> None:
    st = _open(tmp_path)
    try:
        other = SegmentLog(str(tmp_path), "other", capacity_bytes=16 * MIB,
                           segment_bytes=4 * MIB, max_value_bytes=MIB)
        try:
            with pytest.raises(WiringError, match="attached already"):
                TieredStore(st.memory, other, make_promote_policy("never", 1000))
        finally:
            other.close()
    finally:
        st.close()
