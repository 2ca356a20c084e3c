"""MemoryTier alone, in-process (no server, no disk): a put reads back byte-exact, a
replace is atomic under a read lease, eviction gives objects up in the order of the
injected EvictionPolicy (LRU, or any other), and a pinned object's bytes are never freed
by eviction or delete until its lease ends."""

from __future__ import annotations

from typing import Iterator

import pytest

from gcache.server.arena import Arena
from gcache.server.eviction import EvictionPolicy, Resident
from gcache.server.memory_tier import MemoryTier
from gcache.status import Status
from gcache.testing.oracle import value_for
from tierops import put_value, read_value

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

NS = b"ns"
MIB = 1 << 20
SIZE = 260_000  # a 256 KiB chunk (64 granules); 7 MiB of chunks: 28 fit


class NewestFirst(EvictionPolicy):
    """A policy unlike LRU (gives up the newest insert first; hits change nothing)."""

    name = "newest-first"

    def __init__(self) -> None:
        self.objs: dict[Resident, None] = {}

    def on_insert(self, obj: Resident) -> None:
        self.objs[obj] = None

    def on_hit(self, obj: Resident) -> None:
        pass

    def on_remove(self, obj: Resident) -> None:
        self.objs.pop(obj, None)

    def candidates(self, ns: bytes | None = None) -> Iterator[Resident]:
        return (o for o in reversed(self.objs) if ns is None or o.ns == ns)


def _tier(tmp_path, policy: EvictionPolicy | None = None, **kw) -> MemoryTier:
    arena = Arena(str(tmp_path / "a.arena"), 8 * MIB, MIB, prefault=False)
    return MemoryTier(arena, eviction_policy=policy, **kw)


def _put(m: MemoryTier, key: bytes, n: int = SIZE) -> int:
    return put_value(m, NS, key, n)


def _read(m: MemoryTier, key: bytes) -> bytes | None:
    return read_value(m, NS, key)


def _fill(m: MemoryTier, n: int, tag: bytes = b"k") -> list[bytes]:
    keys = [tag + b"%d" % i for i in range(n)]
    for k in keys:
        _put(m, k)
    return keys


def test_put_reads_back_and_a_replace_is_atomic_under_a_lease(tmp_path) -> None:
    m = _tier(tmp_path)
    try:
        v1 = _put(m, b"k", 5000)
        assert _read(m, b"k") == value_for(b"k", 5000)
        old = m.pin_read(NS, b"k", 0, 1 << 40, 0)
        v2 = _put(m, b"k", 7000)  # replaced while a reader holds the old bytes
        assert v2 > v1
        assert bytes(old.view) == value_for(b"k", 5000) and old.version == v1
        assert _read(m, b"k") == value_for(b"k", 7000)
        two = m.stats()["used_bytes"]
        m.unpin(old)  # the old chunk is freed only now
        assert m.stats()["used_bytes"] < two and m.stats()["objects"] == 1
        assert m.pin_read(NS, b"k", 0, 10, v1).status == Status.CONFLICT
    finally:
        m.close()


def test_synchronous_eviction_takes_the_least_recently_used(tmp_path) -> None:
    m = _tier(tmp_path)
    try:
        keys = _fill(m, 28)  # the arena is full
        assert m.touch(NS, keys[0])  # the oldest is now the most recently used
        assert _read(m, keys[1]) is not None  # and a read is a use too
        _put(m, b"new")
        _put(m, b"new2")
        assert m.stats()["evictions"] == 2
        assert not m.exists(NS, keys[2]) and not m.exists(NS, keys[3])
        assert all(m.exists(NS, k) for k in keys[:2] + keys[4:])
        assert m.keys()[-2:] == [(NS, b"new"), (NS, b"new2")]  # the policy's order
    finally:
        m.close()


def test_eviction_asks_the_injected_policy(tmp_path) -> None:
    m = _tier(tmp_path, NewestFirst())
    try:
        keys = _fill(m, 28)
        _put(m, b"new")
        assert not m.exists(NS, keys[-1]), "the newest-first policy gives up the newest"
        assert all(m.exists(NS, k) for k in keys[:-1]) and m.exists(NS, b"new")
    finally:
        m.close()


def test_background_step_evicts_in_policy_order_down_to_the_low_watermark(tmp_path) -> None:
    m = _tier(tmp_path, high_watermark=0.8, low_watermark=0.5)
    try:
        keys = _fill(m, 28)  # 28 of 28: past the high watermark (0.8)
        m.touch(NS, keys[0])
        m.step()
        s = m.stats()
        assert s["used_bytes"] <= 0.5 * s["capacity_bytes"]
        gone = [k for k in keys if not m.exists(NS, k)]
        assert gone == keys[1:len(gone) + 1], "the least recently used go first, in order"
        assert m.exists(NS, keys[0]) and m.exists(NS, keys[-1])
    finally:
        m.close()


def test_a_pinned_object_is_never_freed_by_eviction_or_delete(tmp_path) -> None:
    m = _tier(tmp_path)
    try:
        _put(m, b"pinned")
        lease = m.pin_read(NS, b"pinned", 0, 1 << 40, 0)
        m.touch(NS, b"other")  # a miss: changes nothing
        _fill(m, 60)  # more than the arena holds: eviction passes over the pinned one
        assert m.exists(NS, b"pinned") and m.stats()["evictions"] >= 30
        assert m.delete(NS, b"pinned") and not m.exists(NS, b"pinned")
        _fill(m, 60, b"again")  # its chunk is not reused while the lease lasts
        assert bytes(lease.view) == value_for(b"pinned", SIZE)
        used = m.stats()["used_bytes"]
        m.unpin(lease)
        assert m.stats()["used_bytes"] < used  # freed with the last pin
        assert _read(m, b"pinned") is None
    finally:
        m.close()
