"""A connection holds at most ``4 * max_batch_items`` shm leases; LEASE pins a frame at once.

``_lease`` pins a whole frame with one ``MemoryTier.pin_read_many`` and files its
leases with one lock hold. The per-connection bound must still count only the leases
actually granted, in item order: a miss takes no room, the first items that fit get
leases, and every item after the bound answers BUSY (the SDK reads those with a GET),
hit or miss, with nothing left pinned for them. RELEASE frees the room again. A
LEASE with ``"pk": 1`` gets the same rows packed (six u64 each).
"""

from __future__ import annotations

import pytest

from gcache.protocol import Op, encode_frame, unpack_lease_rows
from gcache.sdk import Client
from gcache.status import Status

from rawwire import RawConn

pytestmark = [pytest.mark.integration]


def _call(c: RawConn, op: int, rid: int, meta: dict) -> dict:
    c.send(encode_frame(op, rid, meta))
    fh, rep = c.read()
    assert fh.status == 0 and fh.request_id == rid, rep
    return rep


def _stats(addr: str) -> dict:
    with Client([addr], transport="tcp", timeout_ms=5000) as c:
        return next(iter(c.stats().values()))


@pytest.mark.timeout(60)
def test_lease_bound_per_connection_in_frame_order(make_cluster, monkeypatch):
    monkeypatch.setenv("GCACHE_MAX_BATCH_ITEMS", "4")  # 16 leases per connection
    cl = make_cluster(1, "16MiB", slab="1MiB")
    addr = cl.addresses[0]
    with Client([addr], transport="tcp", timeout_ms=5000, namespace="a") as w:
        for i in range(0, 20, 4):
            assert w.put_batch([b"k%d" % j for j in range(i, i + 4)],
                               [b"v%d" % j for j in range(i, i + 4)]) == [Status.OK] * 4
    c = RawConn(addr)
    c.auth()
    held = []
    for f, keys in enumerate([range(0, 4), range(4, 8), range(8, 12)]):  # 12 leases held
        rep = _call(c, Op.LEASE, 10 + f, {"ns": b"a", "items": [[b"k%d" % j, 0]
                                                                  for j in keys]})
        assert [x[0] for x in rep["items"]] == [Status.OK] * 4
        held += [x[4] for x in rep["items"]]
    # 4 rooms left: a miss takes none, hits get them in item order
    rep = _call(c, Op.LEASE, 20, {"ns": b"a", "items": [[b"nope", 0], [b"k12", 0],
                                                        [b"k13", 0]]})
    assert [x[0] for x in rep["items"]] == [Status.MISS, Status.OK, Status.OK]
    assert rep["items"][1][1:4] != rep["items"][2][1:4]  # each its own object and offset
    held += [x[4] for x in rep["items"][1:3]]
    assert len(set(held)) == 14 and _stats(addr)["shm_leases"] == 14
    # 2 rooms left: the first two hits get them, a miss between takes none, then BUSY
    rep = _call(c, Op.LEASE, 21, {"ns": b"a", "items": [[b"k15", 0], [b"nope", 0],
                                                        [b"k16", 0], [b"k17", 0]]})
    assert [x[0] for x in rep["items"]] == [Status.OK, Status.MISS, Status.OK,
                                            Status.BUSY]
    held += [rep["items"][0][4], rep["items"][2][4]]
    rep = _call(c, Op.LEASE, 22, {"ns": b"a", "items": [[b"k18", 0], [b"nope", 0]]})
    assert [x[0] for x in rep["items"]] == [Status.BUSY, Status.BUSY]  # full: all BUSY
    assert _stats(addr)["shm_leases"] == 16
    rep = _call(c, Op.RELEASE, 23, {"leases": held[:4]})
    assert rep["st"] == [Status.OK] * 4
    rep = _call(c, Op.RELEASE, 24, {"leases": held[:1]})
    assert rep["st"] == [Status.BAD_REQUEST]  # released already
    rep = _call(c, Op.LEASE, 25, {"ns": b"a", "items": [[b"k18", 0], [b"k19", 0]]})
    assert [x[0] for x in rep["items"]] == [Status.OK, Status.OK]
    assert _stats(addr)["shm_leases"] == 14
    # the packed reply ("pk": 1): the same rows, six u64 each, no list per item
    rep = _call(c, Op.LEASE, 26, {"ns": b"a", "items": [[b"k0", 0], [b"nope", 0]], "pk": 1})
    assert set(rep) == {"packed"}
    rows = unpack_lease_rows(rep["packed"], 2)
    assert rows[0] == Status.OK and rows[1] == 2 and rows[4] not in held
    assert rows[6:] == (Status.MISS, 0, 0, 0, 0, 0)
    assert _stats(addr)["shm_leases"] == 15
    c.sock.close()
