"""The eviction policy's order survives a clean restart (issue 14, item 2): the memory
tier saves each object's place in it into its chunk header at a clean stop and recovery
rebuilds it; after a crash (ranks of an older run) it falls back to creation time."""

from __future__ import annotations

import pytest

from gcache.server.arena import Arena
from gcache.server.memory_tier import MemoryTier
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


def test_after_a_crash_the_order_is_creation_time(tmp_path) -> None:
    m = _tier(tmp_path)
    for k in (b"a", b"b", b"c"):
        put_value(m, NS, k, 5000)
    m.close(clean=True)  # ranks a=1 b=2 c=3 saved
    m = _tier(tmp_path)
    m.touch(NS, b"a")
    put_value(m, NS, b"d", 5000)
    m.close(clean=False)
    m = _tier(tmp_path)
    try:
        assert _order(m) == [b"a", b"b", b"c", b"d"]
    finally:
        m.close()
