"""Properties of placement hashing and the consistent-hash ring.

Statistical bounds use member ids from a few fixed naming patterns (so the
ring layouts are a small, known set checked with margin) while hypothesis
varies cluster size, naming pattern and the sampled keys. Exact properties
(minimal movement, determinism, vectorized == scalar) use arbitrary ids.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import gcache.ring as ring_mod
from gcache.hashing import PLACEMENT_SEED, checksum, placement_hash, vnode_hash
from gcache.ring import Member, Ring

pytestmark = pytest.mark.unit

FAST = settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
PREFIXES = ["srv-", "node", "10.0.0.", "gcache-"]
U64 = st.integers(min_value=0, max_value=2**64 - 1)

ids_st = st.text(min_size=1, max_size=10)
member_st = st.builds(
    Member,
    id=ids_st,
    address=st.just("127.0.0.1:7400"),
    weight=st.sampled_from([0.25, 0.5, 1.0, 1.5, 2.0, 3.0]),
)
members_st = st.lists(member_st, min_size=1, max_size=8, unique_by=lambda m: m.id)


def _members(n: int, prefix: str = "srv-", weights: dict[int, float] | None = None) -> list[Member]:
    w = weights or {}
    return [Member(f"{prefix}{i}", f"10.1.0.{i}:7400", w.get(i, 1.0)) for i in range(n)]


def _hashes(seed: int, n: int) -> list[int]:
    return [placement_hash(b"test", f"key-{seed}-{j}".encode()) for j in range(n)]


def _counts(ring: Ring, hashes: list[int]) -> dict[str, int]:
    counts = dict.fromkeys((m.id for m in ring.members), 0)
    for m in ring.owners(hashes):
        counts[m.id] += 1
    return counts


# -- hashing ------------------------------------------------------------------
def test_hashes_are_pinned() -> None:
    # Computed once. If this fails, the seed or algorithm changed, which
    # would reshuffle every key of every deployed cluster.
    assert PLACEMENT_SEED == 0x6763616368655631
    assert placement_hash(b"default", b"hello") == 872971094639765703
    assert placement_hash(b"ns", b"k1", b"grp") == 15555872132619246986
    assert vnode_hash("srv-0", 0) == 5323612405086196625
    assert checksum(b"gcache") == 17643870930594799983


@FAST
@given(ns=st.binary(max_size=16), k1=st.binary(), k2=st.binary(), g=st.binary(max_size=16))
def test_group_hash_ignores_key(ns: bytes, k1: bytes, k2: bytes, g: bytes) -> None:
    assert placement_hash(ns, k1, g) == placement_hash(ns, k2, g)
    assert placement_hash(ns, k1) == placement_hash(ns, k1)


def test_namespace_separates_keys() -> None:
    assert placement_hash(b"a", b"bc") != placement_hash(b"ab", b"c")
    assert placement_hash(b"ns1", b"k") != placement_hash(b"ns2", b"k")
    assert placement_hash(b"ns1", b"x", b"g") != placement_hash(b"ns2", b"x", b"g")


def test_checksum_accepts_buffers_without_copy() -> None:
    arr = np.arange(64, dtype=np.float16).reshape(8, 8)
    raw = arr.tobytes()
    assert checksum(arr) == checksum(memoryview(arr)) == checksum(raw) == checksum(bytearray(raw))
    assert checksum(memoryview(raw)[8:16]) == checksum(raw[8:16])
    with pytest.raises(ValueError):
        checksum(arr[:, ::2])
    with pytest.raises(TypeError):
        checksum("text")


# -- balance and weights ------------------------------------------------------
@FAST
@given(n=st.integers(3, 16), prefix=st.sampled_from(PREFIXES), seed=st.integers(0, 2**32))
def test_balance_equal_weights(n: int, prefix: str, seed: int) -> None:
    ring = Ring(_members(n, prefix), vnodes_per_weight=160)
    keys = 20_000
    for count in _counts(ring, _hashes(seed, keys)).values():
        assert 0.65 <= count / keys * n <= 1.35
    shares = ring.load_shares()
    assert sum(shares.values()) == pytest.approx(1.0)
    for share in shares.values():
        assert 0.7 <= share * n <= 1.3


@FAST
@given(
    n=st.integers(3, 8),
    heavy=st.integers(0, 7),
    prefix=st.sampled_from(PREFIXES),
    seed=st.integers(0, 2**32),
)
def test_weight_two_gets_about_twice_the_share(n: int, heavy: int, prefix: str, seed: int) -> None:
    heavy %= n
    ring = Ring(_members(n, prefix, {heavy: 2.0}))
    heavy_id = f"{prefix}{heavy}"
    counts = _counts(ring, _hashes(seed, 40_000))
    light = [c for mid, c in counts.items() if mid != heavy_id]
    assert 1.5 <= counts[heavy_id] / (sum(light) / len(light)) <= 2.5
    shares = ring.load_shares()
    light_share = (1.0 - shares[heavy_id]) / (n - 1)
    assert 1.5 <= shares[heavy_id] / light_share <= 2.5


def test_tiny_weight_still_gets_a_vnode() -> None:
    tiny = Member("tiny", "h:1", weight=0.0001)
    ring = Ring([*_members(3), tiny])
    assert ring.owner(vnode_hash("tiny", 0)) == tiny
    assert ring.load_shares()["tiny"] > 0


# -- minimal movement ---------------------------------------------------------
@FAST
@given(members=members_st, new=member_st, seed=st.integers(0, 2**32))
def test_join_moves_keys_only_to_new_member(members: list[Member], new: Member, seed: int) -> None:
    assume(all(m.id != new.id for m in members))
    before = Ring(members)
    after = before.with_member(new)
    assert after.epoch == before.epoch + 1
    hashes = _hashes(seed, 2_000)
    for old, cur in zip(before.owners(hashes), after.owners(hashes)):
        assert cur == old or cur == new


@FAST
@given(
    members=members_st.filter(lambda ms: len(ms) >= 2),
    pick=st.integers(0, 7),
    seed=st.integers(0, 2**32),
)
def test_leave_moves_only_the_leavers_keys(members: list[Member], pick: int, seed: int) -> None:
    gone = members[pick % len(members)]
    before = Ring(members)
    after = before.without(gone.id)
    assert gone.id not in after and len(after) == len(before) - 1
    hashes = _hashes(seed, 2_000)
    for old, cur in zip(before.owners(hashes), after.owners(hashes)):
        assert cur != gone
        if old != gone:
            assert cur == old


@FAST
@given(n=st.integers(2, 15), prefix=st.sampled_from(PREFIXES), seed=st.integers(0, 2**32))
def test_join_moves_about_one_over_n_plus_one(n: int, prefix: str, seed: int) -> None:
    everyone = _members(n + 1, prefix)
    before, after = Ring(everyone[:n]), Ring(everyone)
    hashes = _hashes(seed, 10_000)
    moved = sum(a != b for a, b in zip(before.owners(hashes), after.owners(hashes)))
    assert 0.5 <= moved / len(hashes) * (n + 1) <= 1.6


# -- determinism and lookup ---------------------------------------------------
@FAST
@given(data=st.data(), members=members_st, hashes=st.lists(U64, max_size=50))
def test_member_order_does_not_matter(
    data: st.DataObject, members: list[Member], hashes: list[int]
) -> None:
    shuffled = data.draw(st.permutations(members))
    a, b = Ring(members), Ring(shuffled)
    assert a.members == b.members
    assert a.owners(hashes) == b.owners(hashes)
    assert a.load_shares() == b.load_shares()


@FAST
@given(
    members=members_st,
    ns=st.binary(max_size=8),
    group=st.binary(max_size=8),
    keys=st.lists(st.binary(), min_size=2, max_size=20),
)
def test_group_keys_share_an_owner(
    members: list[Member], ns: bytes, group: bytes, keys: list[bytes]
) -> None:
    ring = Ring(members)
    assert len({ring.owner(placement_hash(ns, k, group)) for k in keys}) == 1


@FAST
@given(members=members_st, hashes=st.lists(U64, max_size=200))
def test_owners_equals_scalar_owner(members: list[Member], hashes: list[int]) -> None:
    ring = Ring(members, vnodes_per_weight=16)
    edges = [0, 2**64 - 1] + [vnode_hash(m.id, 0) + d for m in members for d in (-1, 0, 1)]
    hashes = hashes + [h % 2**64 for h in edges]
    expected = [ring.owner(h) for h in hashes]
    assert ring.owners(hashes) == expected
    assert ring.owners(np.array(hashes, dtype=np.uint64)) == expected
    for m in members:  # a vnode's own position belongs to its member
        assert ring.owner(vnode_hash(m.id, 0)) == m


@FAST
@given(members=members_st, h=U64, n=st.integers(0, 10))
def test_successors_are_distinct_and_start_at_owner(members: list[Member], h: int, n: int) -> None:
    ring = Ring(members)
    succ = ring.successors(h, n)
    assert len(succ) == min(n, len(members))
    assert len({m.id for m in succ}) == len(succ)
    if n:
        assert succ[0] == ring.owner(h)


def test_position_collisions_tie_break_by_member_id(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ring_mod, "vnode_hash", lambda member_id, i: 1_000 * (i + 1))
    members = [Member("b", "h:2"), Member("c", "h:3"), Member("a", "h:1")]
    for order in (members, members[::-1]):
        ring = Ring(order, vnodes_per_weight=4)
        assert ring.owner(0).id == ring.owner(2_500).id == ring.owner(2**64 - 1).id == "a"
        assert [m.id for m in ring.successors(1_000, 3)] == ["a", "b", "c"]
        assert ring.load_shares() == {"a": 1.0, "b": 0.0, "c": 0.0}


# -- view helpers and validation ----------------------------------------------
def test_empty_ring() -> None:
    ring = Ring([])
    assert len(ring) == 0 and ring.load_shares() == {} and ring.owners([]) == []
    with pytest.raises(LookupError, match="ring is empty: no servers in the view"):
        ring.owner(123)
    with pytest.raises(LookupError):
        ring.owners([1])
    one = ring.with_member(Member("s", "h:1"))
    assert one.epoch == 1 and one.owner(123).id == "s" and one.load_shares() == {"s": 1.0}


def test_view_helpers() -> None:
    ring = Ring(_members(3), epoch=7)
    assert ring.epoch == 7 and len(ring) == 3
    assert "srv-1" in ring and "nope" not in ring and 5 not in ring
    assert ring.member("srv-2").address == "10.1.0.2:7400"
    with pytest.raises(KeyError):
        ring.member("nope")
    with pytest.raises(KeyError):
        ring.without("nope")
    with pytest.raises(ValueError):
        ring.with_member(Member("srv-0", "other:1"))
    assert ring.without("srv-0").epoch == 8 and len(ring) == 3  # original unchanged


@pytest.mark.parametrize(
    "build",
    [
        lambda: Member("", "h:1"),
        lambda: Member("a", "h:1", weight=0),
        lambda: Member("a", "h:1", weight=-1.0),
        lambda: Member("a", "h:1", weight=float("nan")),
        lambda: Ring([Member("a", "h:1"), Member("a", "h:2")]),
        lambda: Ring([Member("a", "h:1")], vnodes_per_weight=0),
        lambda: Ring([Member("a", "h:1")], epoch=-1),
        lambda: Ring([Member("a", "h:1")]).owner(2**64),
        lambda: Ring([Member("a", "h:1")]).owner(-1),
        lambda: Ring([Member("a", "h:1")]).owners([2**64]),
        lambda: Ring([Member("a", "h:1")]).owners(np.array([-1])),
        lambda: Ring([Member("a", "h:1")]).successors(0, -1),
    ],
)
def test_invalid_arguments_raise_value_error(build) -> None:
    with pytest.raises(ValueError):
        build()


def test_member_is_frozen() -> None:
    m = Member("a", "h:1")
    with pytest.raises(AttributeError):
        m.weight = 2.0  # type: ignore[misc]


@pytest.mark.unit
@pytest.mark.timeout(30)
def test_small_lookup_is_the_vectorized_rule() -> None:
    """``owners`` of a short list bisects Python lists (the single-key fast path); it
    must name the same owner as the numpy search for every hash, wrap included."""
    import random

    rnd = random.Random(13)
    ring = Ring([Member(f"s{i}", f"h:{i}", 1.0 + i % 3) for i in range(7)])
    hashes = [rnd.getrandbits(64) for _ in range(5000)] + [0, 1, 2**64 - 1]
    hashes += ring._positions[:50].tolist() + [p + 1 for p in ring._positions[:50].tolist()]
    want = ring.owners(np.array(hashes, dtype=np.uint64))
    assert [ring.owners([h])[0] for h in hashes] == want
    assert ring.owners(hashes[:8]) == want[:8]
    with pytest.raises(ValueError):
        ring.owners([1.5])
