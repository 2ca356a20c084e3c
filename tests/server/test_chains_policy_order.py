"""The ``chains`` eviction policy's order, on the policy alone and through a real
in-process MemoryTier on a virtual clock: new short chains go before new long ones and
everything new before anything reused; a chain is given up from its tail; a chain that
grows (also by a piece put before the page it hangs from) moves its pages to its new class; without parent keys it is ``reuse``'s order; a
walk over skipped (pinned) objects or a cycle of parents ends, offering each object
once; and its per-object state goes with the objects."""

from __future__ import annotations

import random

import pytest

from gcache.clock import VirtualClock
from gcache.server.arena import Arena
from gcache.server.eviction import Chains, Reuse
from gcache.server.memory_tier import MemoryTier
from policyops import Obj, keys_of as _keys
from tierops import put_value

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]


def _chain(p: Chains, name: str, n: int, parent: bytes = b"", ns: bytes = b"n") -> list[Obj]:
    """Insert an ``n``-page chain ``name0..`` hanging from ``parent`` (b"": a head)."""
    objs = []
    for i in range(n):
        o = Obj(ns, f"{name}{i}".encode(), parent=parent)
        p.on_insert(o)
        objs.append(o)
        parent = o.key
    return objs


def _drain(p: Chains, ns: bytes | None = None) -> list[bytes]:
    """Evict everything, one first candidate at a time (what the tier does)."""
    out = []
    while (o := next(p.candidates(ns), None)) is not None:
        p.on_remove(o)
        out.append(o.key)
    return out


def test_short_new_chains_go_before_long_ones_and_new_before_reused() -> None:
    p = Chains(bounds=(3, 6))
    long_ = _chain(p, "L", 6)  # class 2 (>= 6 pages)
    _chain(p, "s", 2)  # class 0 (< 3)
    _chain(p, "m", 4)  # class 1
    p.on_hit(long_[0])  # read again: reused, after every new page
    order = _drain(p)
    assert order[:2] == [b"s1", b"s0"], order  # the short chain, tail first
    assert order[2:6] == [b"m3", b"m2", b"m1", b"m0"], order
    assert order[6:] == [b"L5", b"L4", b"L3", b"L2", b"L1", b"L0"], order
    assert len(p) == 0 and p.state_entries() == 0


def test_a_victim_is_replaced_by_a_tail_of_its_subtree() -> None:
    p = Chains()
    a = _chain(p, "a", 3)  # a0 <- a1 <- a2
    b = _chain(p, "b", 2, parent=a[0].key)  # a branch from a0: b0 <- b1
    # a0 is the oldest; its subtree's first-child path ends at a2
    assert next(p.candidates()) is a[2]
    p.on_remove(a[2])
    assert next(p.candidates()) is a[1]
    p.on_remove(a[1])
    assert next(p.candidates()) is b[1]  # a0's remaining subtree: the branch
    assert _drain(p) == [b"b1", b"b0", b"a0"]


def test_a_growing_chain_moves_its_older_pages_to_its_new_class() -> None:
    p = Chains(bounds=(3,))
    first = _chain(p, "g", 2)  # class 0 while the chain has 2 pages
    _chain(p, "s", 1)  # a one-page chain: class 0
    _chain(p, "x", 2, parent=first[-1].key)  # g grows to 4 pages: class 1
    assert _drain(p)[0] == b"s0"  # g's first pages no longer go first


def test_a_piece_put_before_its_parent_joins_the_parents_chain() -> None:
    p = Chains(bounds=(3,))
    _chain(p, "c", 2, parent=b"b1")  # pages 2-3 of a chain, committed before pages 0-1
    _chain(p, "s", 2)  # a 2-page chain
    _chain(p, "b", 2)  # b0 <- b1 <- c0 <- c1: 4 pages, past the bound
    assert _drain(p) == [b"s1", b"s0", b"c1", b"c0", b"b1", b"b0"]
    assert p.state_entries() == 0


def test_without_parent_keys_the_order_is_reuses() -> None:
    rng = random.Random(5)
    c, r = Chains(), Reuse()
    live: list[tuple[Obj, Obj]] = []
    for step in range(3000):
        roll = rng.random()
        if roll < 0.5 or not live:
            k = b"k%d" % rng.randrange(400)
            if any(a.key == k for a, _ in live):
                continue
            pair = (Obj(b"n", k), Obj(b"n", k))
            c.on_insert(pair[0])
            r.on_insert(pair[1])
            live.append(pair)
        elif roll < 0.8:
            a, b = rng.choice(live)
            c.on_hit(a)
            r.on_hit(b)
        else:
            a = next(c.candidates())
            b = next(r.candidates())
            assert a.key == b.key, step
            c.on_remove(a)
            r.on_remove(b)
            live = [x for x in live if x[0] is not a]
    assert _keys(c.candidates()) == _keys(r.candidates())


def test_a_walk_over_skipped_objects_or_a_cycle_ends_offering_each_once() -> None:
    p = Chains()
    _chain(p, "c", 20)
    _chain(p, "d", 5, parent=b"c3")
    offered = list(p.candidates())  # the tier skips every one (all pinned)
    assert len(offered) == 25 and len(set(map(id, offered))) == 25
    q = Chains()  # x's parent is y and y's is x (re-puts can do that)
    x, y = Obj(b"n", b"x", parent=b"y"), Obj(b"n", b"y", parent=b"x")
    q.on_insert(x)
    q.on_insert(y)
    assert sorted(_keys(q.candidates())) == [b"x", b"y"]
    assert len(_drain(q)) == 2 and q.state_entries() == 0


def test_namespace_candidates_are_its_own_and_state_goes_with_the_objects() -> None:
    p = Chains()
    _chain(p, "a", 4, ns=b"x")
    _chain(p, "b", 3, ns=b"y")
    assert _keys(p.candidates(b"y")) == [b"b2", b"b0", b"b1"]  # tail; then unreached ones
    assert _drain(p, b"y") == [b"b2", b"b1", b"b0"]
    assert _keys(p.candidates(b"y")) == [] and len(p) == 4
    # churn: 20,000 chained puts into a cache of 100 objects: state stays bounded
    for i in range(2000):
        _chain(p, f"r{i}-", 10, parent=b"" if i % 3 else b"a1")
        while len(p) > 100:
            p.on_remove(next(p.candidates()))
    assert p.state_entries() <= 3 * 100
    _drain(p)
    assert len(p) == 0 and p.state_entries() == 0


MIB = 1 << 20
SIZE = 200_000
NS = b"ns"


def test_memory_tier_gives_up_the_short_chain_first_tail_first(tmp_path) -> None:
    clock = VirtualClock()
    arena = Arena(str(tmp_path / "a.arena"), 8 * MIB, MIB, prefault=False)
    m = MemoryTier(arena, eviction_policy=Chains(bounds=(4,)), clock=clock.monotonic)
    try:
        put_value(m, NS, b"L0", SIZE, parent=b"")
        s = m.stats()
        fits = s["capacity_bytes"] // s["used_bytes"]
        long_ = [b"L%d" % i for i in range(fits - 3)]
        for prev, k in zip(long_, long_[1:]):  # a long chain (class 1)...
            put_value(m, NS, k, SIZE, parent=prev)
            clock.advance(0.001)
        short = [b"s0", b"s1", b"s2"]
        for prev, k in zip([b""] + short, short):  # ...then a short one fills the arena
            put_value(m, NS, k, SIZE, parent=prev)
            clock.advance(0.001)
        assert m.stats()["evictions"] == 0
        put_value(m, NS, b"n0", SIZE)  # unknown chain: the last new class
        assert m.stats()["evictions"] == 1
        assert not m.exists(NS, b"s2") and m.exists(NS, b"s1") and m.exists(NS, b"s0")
        put_value(m, NS, b"n1", SIZE)
        put_value(m, NS, b"n2", SIZE)
        assert not any(m.exists(NS, k) for k in short)
        assert all(m.exists(NS, k) for k in long_)
    finally:
        m.close()


def test_saved_order_lists_each_object_once_and_changes_nothing() -> None:
    p = Chains(bounds=(3,))
    g = _chain(p, "g", 2)
    _chain(p, "s", 1)
    _chain(p, "x", 2, parent=g[-1].key)  # g's first pages are now in a stale class
    saved = list(p.saved_order())
    assert list(p.saved_order()) == saved and len(set(map(id, saved))) == 5
    assert next(p.candidates()).key == b"s0"  # the walk still reclasses and goes tail first
