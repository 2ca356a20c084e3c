"""The freshness rule (``server/freshness.py``) on a real memory tier, in-process, with
views built by hand: which objects of mutable namespaces a restart and a view change
drop, that content namespaces and objects put after a view was adopted are never
dropped, and which reads of a mutable namespace are answered."""

from __future__ import annotations

import pytest

from gcache.hashing import placement_hash
from gcache.namespace_kinds import NamespaceKinds
from gcache.ring import Member
from gcache.server.arena import Arena
from gcache.server.freshness import EpochFile, Freshness
from gcache.server.memory_tier import MemoryTier
from gcache.view import View
from tierops import put_value, read_value

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

MUT, CONTENT = b"mut", b"kv"
ME = "a"
ABC = tuple(Member(id=i, address=f"{i}:1") for i in "abc")
ABCD = ABC + (Member(id="d", address="d:1"),)


def _tier(tmp_path) -> MemoryTier:
    return MemoryTier(Arena(str(tmp_path / "x.arena"), 8 << 20, 1 << 20, prefault=False))


def _fresh(tmp_path, tier: MemoryTier, persisted: int | None) -> Freshness:
    ef = EpochFile(str(tmp_path / "x.epoch"))
    if persisted is not None:
        ef.store(persisted)
    return Freshness(tier, NamespaceKinds("mut"), ME, ef, tier.next_version)


def _mine(view: View, ns: bytes, keys: list[bytes]) -> list[bool]:
    return [m.id == ME for m in view.ring.owners([placement_hash(ns, k) for k in keys])]


def _held(tier: MemoryTier, ns: bytes, keys: list[bytes]) -> list[bytes]:
    return [k for k in keys if read_value(tier, ns, k) is not None]


KEYS = [f"k{i}".encode() for i in range(60)]


def _fill(tier: MemoryTier) -> None:
    for ns in (MUT, CONTENT):
        for k in KEYS:
            put_value(tier, ns, k, 1000)


def test_restart_keeps_everything_only_when_nothing_changed_while_away(tmp_path):
    tier = _tier(tmp_path)
    _fill(tier)
    f = _fresh(tmp_path, tier, persisted=5)
    f.adopt(View(6, ABC), registered_before=5)  # our registration was the only change
    assert _held(tier, MUT, KEYS) == KEYS and f.stats()["stale_dropped"] == 0
    assert EpochFile(str(tmp_path / "x.epoch")).load() == 6

    f = _fresh(tmp_path, tier, persisted=6)
    put_value(tier, MUT, b"new", 1000)  # put after the start: never from the old life
    f.adopt(View(8, ABC), registered_before=7)  # something happened at epoch 7
    assert _held(tier, MUT, KEYS + [b"new"]) == [b"new"]
    assert _held(tier, CONTENT, KEYS) == KEYS
    assert f.stats()["stale_dropped"] == len(KEYS)
    tier.close()


@pytest.mark.parametrize("persisted,before,epoch", [(None, 5, 6), (5, None, 6), (5, 5, 7)])
def test_restart_drops_when_the_change_history_is_unknown(tmp_path, persisted, before, epoch):
    """No epoch file; no registration before the first view; a view past our own
    registration's epoch (another change right after it)."""
    tier = _tier(tmp_path)
    _fill(tier)
    f = _fresh(tmp_path, tier, persisted)
    f.adopt(View(epoch, ABC), registered_before=before)
    assert _held(tier, MUT, KEYS) == [] and _held(tier, CONTENT, KEYS) == KEYS
    tier.close()


def test_a_range_that_comes_back_loses_only_its_old_mutable_objects(tmp_path):
    tier = _tier(tmp_path)
    _fill(tier)
    f = _fresh(tmp_path, tier, persisted=5)
    v6, v7, v8 = View(6, ABC), View(7, ABCD), View(8, ABC)
    f.adopt(v6, registered_before=5)
    f.adopt(v7)  # d joins and takes part of our range
    moved = [k for k, a, b in zip(KEYS, _mine(v6, MUT, KEYS), _mine(v7, MUT, KEYS))
             if a and not b]
    assert moved
    rewritten = moved[0]
    put_value(tier, MUT, rewritten, 1000)  # a client with a newer view wrote it here
    f.adopt(v8)  # d leaves: the range comes back
    assert _held(tier, MUT, KEYS) == [k for k in KEYS if k not in moved or k == rewritten]
    assert _held(tier, CONTENT, KEYS) == KEYS
    assert f.stats()["stale_dropped"] == len(moved) - 1

    # views skipped (9 unseen): whatever we own may have been away and back
    mine = [k for k, m in zip(KEYS, _mine(v8, MUT, KEYS)) if m]
    f.adopt(View(10, ABC))
    assert _held(tier, MUT, KEYS) == [k for k in KEYS if k not in moved and k not in mine]
    tier.close()


def test_a_server_out_of_the_ring_drops_nothing_and_keeps_its_last_member_epoch(tmp_path):
    tier = _tier(tmp_path)
    _fill(tier)
    f = _fresh(tmp_path, tier, persisted=5)
    f.adopt(View(6, ABC), registered_before=5)
    f.adopt(View(7, ABC[1:]))  # drained: what it holds is still the newest
    assert _held(tier, MUT, KEYS) == KEYS
    assert EpochFile(str(tmp_path / "x.epoch")).load() == 6
    f.adopt(View(8, ABC))  # back: everything it owns now came back
    mine = [k for k, m in zip(KEYS, _mine(View(8, ABC), MUT, KEYS)) if m]
    assert _held(tier, MUT, KEYS) == [k for k in KEYS if k not in mine]
    tier.close()


def test_reads_of_a_mutable_namespace_need_a_view_as_new_as_the_client_and_ownership(tmp_path):
    tier = _tier(tmp_path)
    f = _fresh(tmp_path, tier, persisted=5)
    hashes = [placement_hash(MUT, k) for k in KEYS]
    assert f.readable(None, None, 3) == [False] * 3  # no view reconciled yet
    v6 = View(6, ABC)
    f.adopt(v6, registered_before=5)
    assert f.readable(7, hashes, len(KEYS)) == [False] * len(KEYS)  # client is newer
    assert f.readable(6, hashes, len(KEYS)) == _mine(v6, MUT, KEYS)
    assert f.readable(5, hashes, len(KEYS)) == _mine(v6, MUT, KEYS)
    assert f.readable(None, None, 2) == [True, True]  # a static client: no ownership
    assert f.is_mutable(MUT) and not f.is_mutable(CONTENT)
    tier.close()
