"""A sliced PUT commits only when its slices cover the object exactly, once each.

Before the fix the server counted received bytes: slices [0, 120) and [60, 140) of a
200-byte object add up to 200, so the object committed with bytes [140, 200) never
written by that put (whatever the chunk held before). Now every slice claims its byte
range, an overlapping or empty slice is refused with BAD_REQUEST, and the object stays
invisible until the missing range arrives.
"""

from __future__ import annotations

import os

import pytest

from gcache.protocol import Op, encode_frame
from gcache.status import Status

from rawwire import RawConn, assert_serving

pytestmark = [pytest.mark.integration, pytest.mark.faults]

NS = b"ovl"
PID = 0x5EED_0001


def _put(conn: RawConn, rid: int, key: bytes, total: int, slices: list[tuple[int, bytes]]
         ) -> list[int]:
    items = [[key, total, off, len(b), PID] for off, b in slices]
    conn.send(encode_frame(Op.PUT, rid, {"ns": NS, "items": items},
                           sum(len(b) for _, b in slices)), *(b for _, b in slices))
    fh, meta = conn.read()
    assert fh.status == 0 and fh.request_id == rid, meta
    return meta["st"]


def _get(conn: RawConn, rid: int, key: bytes) -> tuple[int, bytes]:
    conn.send(encode_frame(Op.GET, rid, {"ns": NS, "items": [[key, 0, 1 << 20, 0]]}))
    fh, meta = conn.read()
    assert fh.status == 0, meta
    st, _total, _ver, n = meta["items"][0][:4]
    data = bytearray()
    while len(data) < fh.payload_len:
        data += conn.sock.recv(fh.payload_len - len(data))
    return st, bytes(data)


@pytest.mark.timeout(60)
def test_overlapping_slice_is_refused_and_nothing_commits(cluster):
    value = os.urandom(200)
    with RawConn(cluster.addresses[0]) as c:
        c.auth()
        # one frame: [0, 120) then [60, 140): 200 bytes arrive, [140, 200) never written
        st = _put(c, 2, b"k1", 200, [(0, value[:120]), (60, value[60:140])])
        assert st == [Status.OK, Status.BAD_REQUEST]
        assert _get(c, 3, b"k1")[0] == Status.MISS
        # the same overlap in separate frames, and an exact duplicate of a slice
        assert _put(c, 4, b"k1", 200, [(100, value[100:180])]) == [Status.BAD_REQUEST]
        assert _put(c, 5, b"k1", 200, [(0, value[:120])]) == [Status.BAD_REQUEST]
        assert _get(c, 6, b"k1")[0] == Status.MISS
        # the missing range completes the object with exactly the bytes written
        assert _put(c, 7, b"k1", 200, [(120, value[120:])]) == [Status.OK]
        assert _get(c, 8, b"k1") == (Status.OK, value)


@pytest.mark.timeout(60)
def test_empty_slice_is_refused(cluster):
    with RawConn(cluster.addresses[0]) as c:
        c.auth()
        assert _put(c, 2, b"k2", 100, [(0, b"x" * 100)]) == [Status.OK]  # whole: fine
        assert _put(c, 3, b"k3", 100, [(50, b"")]) == [Status.BAD_REQUEST]
        assert _get(c, 4, b"k3")[0] == Status.MISS
    assert_serving(cluster)
