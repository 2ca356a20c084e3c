"""The EvictionPolicy contract, on the LRU policy alone: candidates come coldest first,
a hit moves an object to the back, a namespace's candidates are only its own, removal
forgets an object in every order, and the config key builds it."""

from __future__ import annotations

import pytest

from gcache.config import EVICTION_POLICIES, OPTIONS, load_config
from gcache.errors import ConfigError
from gcache.server.eviction import LRU, EvictionPolicy, make_policy

from policyops import Obj, keys_of as _keys

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]


def test_candidates_are_least_recently_used_first() -> None:
    p = LRU()
    a, b, c = Obj(b"n", b"a"), Obj(b"n", b"b"), Obj(b"n", b"c")
    for o in (a, b, c):
        p.on_insert(o)
    assert _keys(p.candidates()) == [b"a", b"b", b"c"]
    p.on_hit(a)
    assert _keys(p.candidates()) == [b"b", b"c", b"a"]
    p.on_hit(c)
    assert _keys(p.candidates()) == [b"b", b"a", b"c"]


def test_namespace_candidates_are_only_its_own_in_its_own_order() -> None:
    p = LRU()
    objs = [Obj(b"x", b"x1"), Obj(b"y", b"y1"), Obj(b"x", b"x2"), Obj(b"y", b"y2")]
    for o in objs:
        p.on_insert(o)
    p.on_hit(objs[0])  # x1 is now the newest of x and of everyone
    assert _keys(p.candidates(b"x")) == [b"x2", b"x1"]
    assert _keys(p.candidates(b"y")) == [b"y1", b"y2"]
    assert _keys(p.candidates(b"nobody")) == []
    assert _keys(p.candidates()) == [b"y1", b"x2", b"y2", b"x1"]


def test_remove_forgets_the_object_everywhere_and_a_replace_is_two_objects() -> None:
    p = LRU()
    old, other = Obj(b"n", b"k", version=1), Obj(b"m", b"o")
    p.on_insert(old)
    p.on_insert(other)
    new = Obj(b"n", b"k", version=2)  # a put replaced the key
    p.on_remove(old)
    p.on_insert(new)
    assert [o.version for o in p.candidates(b"n")] == [2]
    assert list(p.candidates()) == [other, new]
    p.on_remove(new)
    assert list(p.candidates(b"n")) == [] and list(p.candidates()) == [other]
    assert len(p) == 1


def test_candidates_are_lazy() -> None:
    p = LRU()
    for i in range(100_000):
        p.on_insert(Obj(b"n", b"%d" % i))
    it = p.candidates()
    assert next(it).key == b"0" and next(it).key == b"1"  # no list is built first


def test_config_key_builds_the_policy_and_refuses_unknown_names() -> None:
    assert OPTIONS["eviction_policy"].default == "lru" and "lru" in EVICTION_POLICIES
    p = make_policy("lru")
    assert isinstance(p, EvictionPolicy) and p.name == "lru"
    with pytest.raises(ConfigError, match="lru"):
        make_policy("lfu")
    assert load_config("server", env={"GCACHE_EVICTION_POLICY": "lru"}).eviction_policy == "lru"
    with pytest.raises(ConfigError, match="eviction_policy"):
        load_config("server", env={"GCACHE_EVICTION_POLICY": "lfu"})
