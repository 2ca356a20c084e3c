"""TieredStore in-process, mover stepped by hand: demotion, promotion, versions, one copy
per key, deletes and replaces across tiers, touch, and reconciliation after a restart."""

from __future__ import annotations

import pytest

from gcache.server.arena import Arena
from gcache.server.memory_tier import MemoryTier
from gcache.server.disk import SegmentLog
from gcache.server.tiered_store import TieredStore
from gcache.server.tiering import make_promote_policy
from gcache.status import Status
from gcache.testing.oracle import value_for

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

NS = b"ns"
MIB = 1 << 20
SIZE = 200_000  # a 196 KiB chunk: 36 in the 7 MiB arena


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _open(tmp_path, policy: str = "never", clock: Clock | None = None) -> TieredStore:
    arena = Arena(str(tmp_path / "a.arena"), 8 * MIB, MIB, prefault=False)
    mem = MemoryTier(arena, high_watermark=0.8, low_watermark=0.5)
    disk = SegmentLog(str(tmp_path), "t", capacity_bytes=64 * MIB, segment_bytes=4 * MIB,
                      max_value_bytes=MIB)
    return TieredStore(mem, disk, make_promote_policy(policy, 1000, clock or Clock()),
                       room_wait_s=0.0)


def _put(st: TieredStore, key: bytes, n: int = SIZE) -> int:
    slot = st.begin_put(NS, key, n, 0, n, 0)
    assert slot.status == Status.OK
    slot.view[:] = value_for(key, n)
    version = slot.token.obj.version
    assert st.finish_put(slot) == Status.OK
    return version


def _get(st: TieredStore, key: bytes, ev: int = 0) -> tuple[Status, bytes | None, int]:
    p = st.pin_read(NS, key, 0, 1 << 40, ev)
    try:
        return p.status, (bytes(p.view) if p.view is not None else None), p.version
    finally:
        st.unpin(p)


def _where(st: TieredStore, key: bytes) -> tuple[bool, bool]:
    return st.memory.exists(NS, key), st.disk.exists(NS, key)


def _fill(st: TieredStore, n: int, tag: bytes = b"k") -> list[bytes]:
    keys = [tag + b"%d" % i for i in range(n)]
    for k in keys:
        _put(st, k)
        st.step()
    return keys


def test_demotion_keeps_bytes_and_versions(tmp_path):
    st = _open(tmp_path)
    versions = {}
    keys = [b"k%d" % i for i in range(60)]  # 12 MB through 7 MiB of memory
    for k in keys:
        versions[k] = _put(st, k)
        st.step()
    s = st.stats()
    assert s["demoted"] > 20 and s["evictions"] == 0
    for k in keys:
        status, data, version = _get(st, k)
        assert status == Status.OK and data == value_for(k, SIZE)
        assert version == versions[k], "a tier crossing must not change the version"
        assert _where(st, k) != (False, False)
    assert _where(st, keys[0]) == (False, True)
    st.close()


def test_promotion_second_hit_keeps_version_and_a_clean_disk_copy(tmp_path):
    clock = Clock()
    st = _open(tmp_path, "second-hit", clock)
    keys = _fill(st, 40)
    cold = keys[0]
    v0 = _get(st, cold)[2]
    assert _where(st, cold) == (False, True)  # first hit: stays on disk
    clock.t += 0.5
    assert _get(st, cold)[:2] == (Status.OK, value_for(cold, SIZE))
    assert _where(st, cold) == (True, True), "promoted, and the disk copy stays as a clean copy"
    assert _get(st, cold, ev=v0)[0] == Status.OK  # same version in memory
    assert st.stats()["promoted"] == 1
    # re-demoting the unchanged object drops it from memory without a disk write
    written = st.stats()["disk_written_bytes"]
    for k in keys:
        if k != cold:
            st.memory.touch(NS, k)  # make `cold` the LRU head again
    st._demote_batch(SIZE)
    assert _where(st, cold) == (False, True)
    assert st.stats()["disk_written_bytes"] == written
    st.close()


def test_put_over_a_disk_copy_and_delete_remove_it_from_both_tiers(tmp_path):
    st = _open(tmp_path, "first")
    keys = _fill(st, 40)
    a, b, c = keys[0], keys[1], keys[2]
    assert _where(st, a) == (False, True)
    _put(st, a, 5000)  # replace: the disk copy must die now
    assert _where(st, a) == (True, False)
    assert _get(st, a)[1] == value_for(a, 5000)
    _get(st, b)  # promote b: now in both tiers
    assert _where(st, b) == (True, True)
    assert st.delete(NS, b) and _where(st, b) == (False, False)
    assert st.delete(NS, c) and _where(st, c) == (False, False)  # disk only
    assert not st.delete(NS, c)
    assert _get(st, b)[0] == Status.MISS and _get(st, c)[0] == Status.MISS
    st.close(clean=False)
    st2 = _open(tmp_path)  # crash-style restart: deaths were persisted
    assert _get(st2, a)[1] == value_for(a, 5000)
    assert _get(st2, b)[0] == Status.MISS and _get(st2, c)[0] == Status.MISS
    st2.close()


def test_touch_and_exists_see_both_tiers(tmp_path):
    st = _open(tmp_path)
    keys = _fill(st, 40)
    on_disk, in_mem = keys[0], keys[-1]
    assert _where(st, on_disk) == (False, True) and _where(st, in_mem)[0]
    assert st.exists(NS, on_disk) and st.exists(NS, in_mem) and not st.exists(NS, b"nope")
    assert st.touch(NS, on_disk) and st.touch(NS, in_mem) and not st.touch(NS, b"nope")
    assert st.disk.index[(NS, on_disk)].ref, "touch marks the disk record hot"
    assert next(reversed(st.memory.keys())) == (NS, in_mem)
    st.close()


def test_restart_reconciles_versions_across_tiers(tmp_path):
    st = _open(tmp_path)
    keys = _fill(st, 40)
    top = max(e.version for e in st.disk.index.values())
    st.close(clean=True)
    (tmp_path / "a.arena").unlink()  # the memory tier is gone (host reboot), disk stays
    st2 = _open(tmp_path)
    assert st2.memory.stats()["objects"] == 0
    v = _put(st2, b"new")
    assert v > top, "a version must never be reused after the arena is lost"
    present = sum(_get(st2, k)[0] == Status.OK for k in keys)
    assert present == len(st.disk.index)  # every disk object is still served
    st2.close()


def test_corrupt_memory_copy_is_not_demoted(tmp_path):
    st = _open(tmp_path)
    _put(st, b"victim")
    o = st.memory._index[(NS, b"victim")]
    st.memory.arena.buf[o.data_off + 10] ^= 0xFF  # a bit flip in memory
    _fill(st, 40)
    assert not st.exists(NS, b"victim")
    assert st.stats()["corrupt_dropped"] == 1
    st.close()
