"""The order rules of each eviction policy beyond LRU (``reuse``, ``s3fifo``), on the
policy alone, and every policy (LRU too) driving a real in-process MemoryTier on a
virtual clock: which object goes first after inserts, hits and re-puts, per namespace
too, that a skipped (pinned) candidate does not end the walk, and that every configured
name builds its policy."""

from __future__ import annotations

import pytest

from gcache.clock import VirtualClock
from gcache.config import EVICTION_POLICIES
from gcache.server.arena import Arena
from gcache.server.eviction import S3FIFO, EvictionPolicy, Reuse, make_policy
from gcache.server.memory_tier import MemoryTier
from policyops import Obj, keys_of as _keys
from tierops import put_value

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]


def _insert(p: EvictionPolicy, *keys: bytes, ns: bytes = b"n") -> dict[bytes, Obj]:
    objs = {k: Obj(ns, k) for k in keys}
    for o in objs.values():
        p.on_insert(o)
    return objs


def _reput(p: EvictionPolicy, old: Obj) -> Obj:
    new = Obj(old.ns, old.key, version=old.version + 1)
    p.on_remove(old)
    p.on_insert(new)
    return new


def test_every_configured_name_builds_its_policy() -> None:
    for name in EVICTION_POLICIES:
        assert make_policy(name).name == name
    assert set(EVICTION_POLICIES) >= {"lru", "reuse", "s3fifo"}


# ------------------------------------------------------------------------- reuse


def test_reuse_gives_up_never_reused_objects_before_any_reused_one() -> None:
    p = Reuse()
    o = _insert(p, b"a", b"b", b"c", b"d")
    p.on_hit(o[b"a"])  # a and c were read again: reused
    p.on_hit(o[b"c"])
    assert _keys(p.candidates()) == [b"b", b"d", b"a", b"c"]
    p.on_hit(o[b"a"])  # within the reused class: least recently used first
    assert _keys(p.candidates()) == [b"b", b"d", b"c", b"a"]
    _insert(p, b"e")  # a new object goes before every reused one, after older fresh ones
    assert _keys(p.candidates()) == [b"b", b"d", b"e", b"c", b"a"]


def test_reuse_counts_a_reput_of_a_key_it_held_as_a_reuse() -> None:
    p = Reuse()
    o = _insert(p, b"a", b"b")
    new_a = _reput(p, o[b"a"])  # a prefix miss re-put it: someone asked for it again
    assert _keys(p.candidates()) == [b"b", b"a"] and new_a in set(p.candidates())
    evicted = next(p.candidates())  # b evicted, then put again later
    p.on_remove(evicted)
    _insert(p, b"b", b"x")
    assert _keys(p.candidates()) == [b"x", b"a", b"b"]
    assert len(p) == 3


def test_reuse_namespace_candidates_are_its_own_in_class_order() -> None:
    p = Reuse()
    x = _insert(p, b"x1", b"x2", ns=b"x")
    _insert(p, b"y1", ns=b"y")
    p.on_hit(x[b"x1"])
    assert _keys(p.candidates(b"x")) == [b"x2", b"x1"]
    assert _keys(p.candidates(b"y")) == [b"y1"]
    assert _keys(p.candidates(b"none")) == []
    p.on_remove(x[b"x1"])
    p.on_remove(x[b"x2"])
    assert _keys(p.candidates(b"x")) == [] and _keys(p.candidates()) == [b"y1"]


# ------------------------------------------------------------------------ s3fifo


def test_s3fifo_evicts_one_hit_wonders_from_the_small_queue_first() -> None:
    p = S3FIFO(small_fraction=0.5)
    o = _insert(p, b"a", b"b", b"c", b"d")  # all in small (100 % of the bytes)
    p.on_hit(o[b"a"])  # a was read while new: the walk moves it to main
    assert next(p.candidates()) is o[b"b"]
    p.on_remove(o[b"b"])
    # small now holds c, d (2 of 3 objects > 50 %): c goes next, a stays in main
    assert next(p.candidates()) is o[b"c"]


def test_s3fifo_main_gives_a_read_object_another_round() -> None:
    p = S3FIFO(small_fraction=0.1)
    o = _insert(p, b"a", b"b", b"c")
    for k in (b"a", b"b", b"c"):  # each evicted once, then back: the ghost sends it to main
        p.on_remove(o[k])
    m = _insert(p, b"a", b"b", b"c")
    p.on_hit(m[b"a"])  # a has freq 1: the walk passes it (freq -> 0) and offers b
    assert next(p.candidates()) is m[b"b"]
    p.on_remove(m[b"b"])
    assert next(p.candidates()) is m[b"c"]
    p.on_remove(m[b"c"])
    assert next(p.candidates()) is m[b"a"]  # its extra round is spent


def test_s3fifo_walk_survives_skipped_candidates_and_offers_each_once() -> None:
    p = S3FIFO()
    o = _insert(p, *[b"%d" % i for i in range(20)])
    p.on_hit(o[b"3"])
    offered = list(p.candidates())  # the tier skips every one (all pinned)
    assert len(offered) == 20 and len(set(map(id, offered))) == 20
    assert _keys(p.candidates(b"n"))[:3] == [b"0", b"1", b"2"]  # quota order: oldest first
    assert len(p) == 20


# ------------------------------------------------------------ through the memory tier

MIB = 1 << 20
SIZE = 200_000
NS = b"ns"


@pytest.mark.parametrize("name", ["lru", "reuse", "s3fifo", "chains"])
def test_memory_tier_evicts_the_unread_before_the_read(tmp_path, name: str) -> None:
    clock = VirtualClock()
    arena = Arena(str(tmp_path / "a.arena"), 8 * MIB, MIB, prefault=False)
    m = MemoryTier(arena, eviction_policy=make_policy(name), clock=clock.monotonic)
    try:
        put_value(m, NS, b"k0", SIZE)  # what one object takes, as the allocator sizes it
        clock.advance(0.001)
        s = m.stats()
        keys = [b"k%d" % i for i in range(s["capacity_bytes"] // s["used_bytes"])]
        for k in keys[1:]:  # the arena is now full: the next put evicts
            put_value(m, NS, k, SIZE)
            clock.advance(0.001)
        assert m.stats()["evictions"] == 0
        read = keys[:4]  # the oldest four are read again (a shared prefix)
        for k in read:
            assert m.touch(NS, k)
        for i in range(4):
            put_value(m, NS, b"new%d" % i, SIZE)
        s = m.stats()
        assert s["evictions"] == 4
        assert all(m.exists(NS, k) for k in read), f"{name} kept the reused objects"
        assert not any(m.exists(NS, k) for k in keys[4:8])
    finally:
        m.close()
