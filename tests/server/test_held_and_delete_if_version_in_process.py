"""The handoff's Tier calls, in process: ``held()`` is a chunked snapshot of committed
objects that never holds the lock between records (puts and deletes run while it is
walked), ``delete_if_version`` deletes only the version it names, and an if-absent
commit is skipped when either tier holds the key. MemoryTier alone and the TieredStore
(a disk-only key, a key with a clean copy in both tiers)."""

from __future__ import annotations

import pytest

from gcache.server.arena import Arena
from gcache.server.disk import SegmentLog
from gcache.server.memory_tier import MemoryTier
from gcache.server.tier import HELD_CHUNK, HeldObject
from gcache.server.tiered_store import TieredStore
from gcache.server.tiering import make_promote_policy
from gcache.status import Status
from gcache.testing.oracle import value_for
from tierops import put_value, read_value

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

NS = b"ns"
MIB = 1 << 20


def _mem(tmp_path, mib: int = 32) -> MemoryTier:
    return MemoryTier(Arena(str(tmp_path / "a.arena"), mib * MIB, MIB, prefault=False))


def _store(tmp_path) -> TieredStore:
    mem = MemoryTier(Arena(str(tmp_path / "a.arena"), 8 * MIB, MIB, prefault=False),
                     high_watermark=0.8, low_watermark=0.5)
    disk = SegmentLog(str(tmp_path), "t", capacity_bytes=64 * MIB, segment_bytes=4 * MIB,
                      max_value_bytes=MIB)
    return TieredStore(mem, disk, make_promote_policy("first", 1000), room_wait_s=0.0)


def _put_ia(tier, key: bytes, value: bytes) -> Status:
    slot = tier.begin_put(NS, key, len(value), 0, len(value), 0)
    assert slot.status == Status.OK
    slot.view[:] = value
    return tier.finish_put(slot, if_absent=True)


def test_held_lists_committed_objects_only(tmp_path):
    m = _mem(tmp_path)
    try:
        versions = {b"k%d" % i: put_value(m, NS, b"k%d" % i, 1000 + i) for i in range(50)}
        pending = m.begin_put(NS, b"uncommitted", 100, 0, 100, 0)  # never visible
        got = list(m.held())
        assert sorted(got) == sorted(HeldObject(NS, k, 1000 + int(k[1:]), v)
                                     for k, v in versions.items())
        m.abort_put(pending)
    finally:
        m.close()


def test_held_walk_lets_puts_and_deletes_run_between_records(tmp_path):
    m = _mem(tmp_path)
    try:
        n = 3 * HELD_CHUNK
        keys = [b"w%d" % i for i in range(n)]
        for k in keys:
            put_value(m, NS, k, 100)
        walk = m.held()
        first = next(walk)  # the first chunk is read; the lock is free again
        late = keys[-1]  # in the last chunk, deleted before the walk reaches it
        assert m.delete(NS, late)
        put_value(m, NS, b"new-during-walk", 100)  # the lock is not held: no deadlock
        rest = [first, *walk]
        seen = {h.key for h in rest}
        assert late not in seen
        assert seen >= set(keys) - {late}
        assert len(rest) == len(seen)  # each key once
    finally:
        m.close()


def test_delete_if_version_deletes_only_that_version(tmp_path):
    m = _mem(tmp_path)
    try:
        v1 = put_value(m, NS, b"a", 500)
        v2 = put_value(m, NS, b"a", 600)  # replaced: v1 is gone, v2 is current
        assert not m.delete_if_version(NS, b"a", v1)
        assert read_value(m, NS, b"a") == value_for(b"a", 600)
        assert m.delete_if_version(NS, b"a", v2)
        assert read_value(m, NS, b"a") is None
        assert not m.delete_if_version(NS, b"a", v2)  # absent: nothing to delete
        assert not m.delete_if_version(NS, b"never", 1)
    finally:
        m.close()


def test_if_absent_commit_skipped_when_held(tmp_path):
    m = _mem(tmp_path)
    try:
        put_value(m, NS, b"held", 300)
        used = m.stats()["used_bytes"]
        assert _put_ia(m, b"held", b"x" * 300) == Status.OK
        assert m.stats()["used_bytes"] == used  # the skipped put's chunk was freed
        assert read_value(m, NS, b"held") == value_for(b"held", 300)
        assert _put_ia(m, b"absent", b"y" * 300) == Status.OK
        assert read_value(m, NS, b"absent") == b"y" * 300
        s = m.stats()
        assert s["put_if_absent_skipped"] == 1
        assert s["objects"] == 2 and s["pending_puts"] == 0
    finally:
        m.close()


def test_tiered_store_held_delete_if_version_and_if_absent_across_tiers(tmp_path):
    st = _store(tmp_path)
    try:
        size = 200_000
        keys = [b"t%d" % i for i in range(60)]  # 12 MB through 8 MiB of memory
        versions = {}
        for k in keys:
            versions[k] = put_value(st, NS, k, size)
            st.step()
        cold = keys[0]
        assert (st.memory.exists(NS, cold), st.disk.exists(NS, cold)) == (False, True)
        assert read_value(st, NS, cold) == value_for(cold, size)  # promoted ("first")
        assert (st.memory.exists(NS, cold), st.disk.exists(NS, cold)) == (True, True)
        disk_only = next(k for k in keys[1:] if not st.memory.exists(NS, k))
        got = list(st.held())
        assert sorted(got) == sorted(HeldObject(NS, k, size, versions[k]) for k in keys)
        # if-absent against a key only on disk: skipped, the disk value stays
        assert _put_ia(st, disk_only, b"z" * size) == Status.OK
        assert st.stats()["put_if_absent_skipped"] == 1
        assert read_value(st, NS, disk_only) == value_for(disk_only, size)
        assert not st.memory.exists(NS, disk_only) or st.disk.exists(NS, disk_only)
        # delete-if-version: a wrong version keeps both copies; the right one removes both
        assert not st.delete_if_version(NS, cold, versions[cold] + 1000)
        assert st.delete_if_version(NS, cold, versions[cold])
        assert (st.memory.exists(NS, cold), st.disk.exists(NS, cold)) == (False, False)
        d2 = next(k for k in reversed(keys) if st.disk.exists(NS, k)
                  and not st.memory.exists(NS, k) and k != disk_only)
        assert st.delete_if_version(NS, d2, versions[d2])
        assert not st.exists(NS, d2)
        # a newer put in memory over a disk copy: the old version deletes nothing
        k3 = next(k for k in keys if st.disk.exists(NS, k) and not st.memory.exists(NS, k)
                  and k not in (disk_only, d2))
        put_value(st, NS, k3, 1000)
        assert not st.delete_if_version(NS, k3, versions[k3])
        assert read_value(st, NS, k3) == value_for(k3, 1000)
    finally:
        st.close()
