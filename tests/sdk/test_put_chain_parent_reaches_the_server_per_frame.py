"""``chain_parent`` on put reaches the server on every frame: a frame that starts with a
later key (or a later slice of a key) names the key before it (``frame_chain``), a
transport's sub-frame is renamed too, and a real server with ``--eviction-policy
chains`` then sees one 12-page chain (not pieces), put as one-slice frames over two
connections (so out of order) over TCP, or as shm staged puts (PUT_STAGED frames of
several values): after a short chain, it is given up tail first, and pages put with no
chain_parent stay longest."""

from __future__ import annotations

import pytest

from gcache.bench.trace import SLAB, arena_bytes, page_bytes_for
from gcache.sdk import Client, Status
from gcache.sdk.transports.base import PutItem, Work, frame_chain
from gcache.sdk.transports.onesided import OneSidedTransport


def _items(spec: list[tuple[bytes, int]]) -> list[PutItem]:
    """One PutItem per (key, batch index)."""
    return [PutItem(k, 1, 0, 1, 0, b"x", None, i) for k, i in spec]


@pytest.mark.unit
@pytest.mark.timeout(30)
def test_each_frame_names_the_key_before_its_first() -> None:
    keys = [b"a", b"b", b"c", b"d"]
    before = {0: b"p", 1: b"a", 2: b"b", 3: b"c"}.get
    assert frame_chain(_items([(b"a", 0), (b"b", 1)]), before) == b"p"
    assert frame_chain(_items([(b"c", 2), (b"d", 3)]), before) == b"b"
    assert frame_chain(_items([(b"b", 1), (b"b", 1), (b"c", 2)]), before) == b"a"  # slices
    assert frame_chain(_items([(b"a", 0), (b"c", 2)]), before) is None  # not consecutive
    work = Work(1, b"n", _items(list(zip(keys, range(4)))), 0.0, None, {"ch": b"p", "x": 1})
    sub = OneSidedTransport.subset(work, [2, 3])
    assert sub.extra == {"ch": b"b", "x": 1}
    assert OneSidedTransport.subset(work, [0, 1]).extra["ch"] == b"p"
    assert "ch" not in OneSidedTransport.subset(work, [0, 2]).extra


@pytest.mark.integration
@pytest.mark.timeout(60)
def test_a_chain_put_in_many_frames_is_one_chain_at_the_server(make_cluster) -> None:
    key_len = 3
    page = page_bytes_for(key_len)
    cap = 32  # pages: 2 slab pages of 16 chunks
    cl = make_cluster(1, str(arena_bytes(cap)), slab=str(SLAB),
                      extra=["--eviction-policy", "chains", "--high-watermark", "1.0",
                             "--low-watermark", "0.999"])
    with Client(cl.addresses, namespace="trace", transport="tcp", conns_per_server=2,
                slice_bytes=2048, frame_target_bytes=2048) as c:
        long_ = [b"L%02d" % i for i in range(12)]  # 10-29 pages: the second new class
        short = [b"S%02d" % i for i in range(3)]  # < 10 pages: the first
        plain = [b"U%02d" % i for i in range(cap - 15)]  # unknown: the last new class
        val = bytes(page)
        assert c.put_batch(long_, [val] * 12, chain_parent=b"") == [Status.OK] * 12
        assert c.put_batch(plain, [val] * len(plain)) == [Status.OK] * len(plain)
        assert c.put_batch(short, [val] * 3, chain_parent="") == [Status.OK] * 3
        assert all(c.exists_batch(long_ + short + plain))
        for i in range(5):  # each evicts one: the short chain, then the long one's tail
            assert c.put(b"X%02d" % i, val) == Status.OK
        assert c.exists_batch(short) == [False] * 3
        assert c.exists_batch(long_) == [True] * 10 + [False] * 2
        assert all(c.exists_batch(plain))


@pytest.mark.integration
@pytest.mark.timeout(60)
def test_shm_staged_puts_carry_the_chain_parent(make_cluster) -> None:
    cl = make_cluster(1, "16MiB", extra=["--eviction-policy", "chains", "--high-watermark",
                                         "1.0", "--low-watermark", "0.999"])
    val = bytes(300 << 10)  # frames past one_sided_min_bytes: PUT_STAGED, not plain PUT
    with Client(cl.addresses, namespace="c", transport="shm", conns_per_server=2) as c:
        assert c.put("probe", val) == Status.OK
        st = next(iter(c.stats().values()))
        fits = st["capacity_bytes"] // st["used_bytes"]
        assert c.delete("probe") == Status.OK
        long_ = [b"L%02d" % i for i in range(12)]  # two 6-value frames, one per connection
        short = [b"S%02d" % i for i in range(3)]
        plain = [b"U%02d" % i for i in range(fits - 15)]
        assert c.put_batch(long_, [val] * 12, chain_parent=b"") == [Status.OK] * 12
        for k in plain:
            assert c.put(k, val) == Status.OK
        assert c.put_batch(short, [val] * 3, chain_parent=b"") == [Status.OK] * 3
        assert all(c.exists_batch(long_ + short + plain))
        for i in range(5):
            assert c.put(b"X%02d" % i, val) == Status.OK
        assert c.exists_batch(short) == [False] * 3
        assert c.exists_batch(long_) == [True] * 10 + [False] * 2
        assert all(c.exists_batch(plain))
