"""Reservations (a sliced put waiting for slices, held by a connection) count against
the writer's namespace quota: they are never evicted to make room, so a second put past
the quota is refused, and another namespace is never evicted for it. Released when the
holder closes. Also: promotion from disk never takes a namespace past its quota."""

from __future__ import annotations

import pytest

from gcache.quotas import QuotaStore
from gcache.server.arena import Arena
from gcache.server.memory_tier import Holder, MemoryTier
from gcache.status import Status
from gcache.testing.oracle import value_for

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

MIB = 1 << 20


def _tier(tmp_path, quota: str = "1MiB") -> MemoryTier:
    p = tmp_path / "q.toml"
    p.write_text(f'[[quota]]\nnamespaces = "a/*"\nmemory_bytes = "{quota}"\n')
    arena = Arena(str(tmp_path / "a.arena"), 8 * MIB, MIB, prefault=False)
    return MemoryTier(arena, quotas=QuotaStore(str(p)))


def _put(m: MemoryTier, ns: bytes, key: bytes, n: int) -> Status:
    slot = m.begin_put(ns, key, n, 0, n, 0)
    if slot.status != Status.OK:
        return slot.status
    slot.view[:] = value_for(key, n)
    return m.finish_put(slot)


def test_reserved_chunk_counts_and_is_released_with_its_holder(tmp_path):
    m = _tier(tmp_path)
    try:
        for i in range(10):
            assert _put(m, b"b/x", b"b%d" % i, 200_000) == Status.OK
        h = Holder()
        n = 600_000
        first = m.begin_put(b"a/x", b"big", n, 0, 1000, 7, holder=h)  # a sliced put, 1 slice
        assert first.status == Status.OK
        first.view[:] = value_for(b"big", 1000)
        assert m.finish_put(first) == Status.OK  # waits for more slices, reserved
        assert m.namespace_usage()[b"a/x"][0] >= n
        assert _put(m, b"a/x", b"other", n) == Status.NO_SPACE  # reservation counts
        assert m.stats()["quota_refused"] == 1
        assert all(m.exists(b"b/x", b"b%d" % i) for i in range(10))  # b untouched
        m.release_holder(h)  # its connection closed
        assert b"a/x" not in m.namespace_usage()
        assert _put(m, b"a/x", b"other", n) == Status.OK
    finally:
        m.close()


def test_admit_never_takes_a_namespace_past_its_quota(tmp_path):
    m = _tier(tmp_path, "512KiB")
    try:
        assert _put(m, b"a/x", b"k1", 400_000) == Status.OK
        data = memoryview(value_for(b"k2", 400_000))
        from gcache.hashing import checksum

        assert not m.admit(b"a/x", b"k2", data, 10_000, checksum(data), lambda: True)
        assert m.admit(b"b/x", b"k2", data, 10_001, checksum(data), lambda: True)
    finally:
        m.close()
