"""ALLOC then COMMIT with no write in between publishes nothing.

Before the fix the server checksummed whatever the reserved chunk held at COMMIT and
published it under a fresh, valid checksum: over plain TCP, a client in another
namespace got back all 204,800 bytes of an object that had just been deleted. Now an
ALLOC item must carry the writer's xxh3 of the value (a 5-field item is refused), and
COMMIT refuses (CORRUPT, chunk freed, counted) bytes that do not hash to it. A TCP PUT
that carries a checksum is verified the same way.
"""

from __future__ import annotations

import os

import pytest

from gcache.hashing import checksum
from gcache.protocol import Op, encode_frame
from gcache.sdk import Client
from gcache.status import Status

from rawwire import RawConn, assert_serving

pytestmark = [pytest.mark.integration, pytest.mark.faults]

SIZE = 204_800
KEY = b"k" * 16  # same key length in both namespaces: the data lands at the same offset


@pytest.fixture
def cluster(make_cluster):
    # ALLOC is served only to writers trusted with the arena (NIXL peers, or same-host
    # peers under --shm-trusted-writers): the checks below are about such a writer
    return make_cluster(1, extra=["--shm-trusted-writers", "true"])


def _call(c: RawConn, op: int, rid: int, meta: dict) -> dict:
    c.send(encode_frame(op, rid, meta))
    fh, rep = c.read()
    assert fh.request_id == rid and fh.opcode == op, rep
    assert fh.status == 0, (Status(fh.status).name, rep)
    return rep


def _stats(c: RawConn, rid: int) -> dict:
    return _call(c, Op.STATS, rid, {})["stats"]


@pytest.mark.timeout(60)
def test_alloc_commit_without_write_publishes_nothing(cluster):
    addr = cluster.addresses[0]
    secret = os.urandom(SIZE)
    with Client([addr], namespace="victim", transport="tcp", timeout_ms=5000) as v:
        assert v.put(KEY, secret) == Status.OK
        assert v.delete(KEY) == Status.OK  # its chunk is free, its bytes still there

    with RawConn(addr) as c:
        c.auth()
        # an ALLOC without the value's checksum is refused outright
        c.send(encode_frame(Op.ALLOC, 2, {"ns": b"thief", "items": [[KEY, SIZE, 0, SIZE, 0]]}))
        fh, rep = c.read()
        assert fh.status == Status.BAD_REQUEST and "checksum" in rep["error"], rep
    with RawConn(addr) as c:
        c.auth()
        before = _stats(c, 2)["put_checksum_mismatch"]
        # with a checksum (of bytes it never writes): COMMIT refuses, nothing is published
        want = checksum(os.urandom(SIZE))
        rep = _call(c, Op.ALLOC, 3, {"ns": b"thief", "items": [[KEY, SIZE, 0, SIZE, 0, want]]})
        st, _off, sid = rep["items"][0]
        assert st == Status.OK
        assert _call(c, Op.COMMIT, 4, {"slots": [sid], "abort": []})["st"] == [Status.CORRUPT]
        assert _stats(c, 5)["put_checksum_mismatch"] == before + 1
        # a checksum that happens to be the stale bytes' own is not a way in either: the
        # writer would have to know the deleted value, i.e. have read it legitimately
    for transport in ("tcp", "shm"):
        with Client([addr], namespace="thief", transport=transport, timeout_ms=5000) as t:
            assert t.get(KEY) is None
            assert t.exists(KEY) is False
    assert_serving(cluster)


@pytest.mark.timeout(60)
def test_tcp_put_with_wrong_checksum_is_refused(cluster):
    value = os.urandom(4096)
    with RawConn(cluster.addresses[0]) as c:
        c.auth()
        bad = checksum(value) ^ 1
        c.send(encode_frame(Op.PUT, 2, {"ns": b"n", "items": [[b"a", 4096, 0, 4096, 0, bad]]},
                            4096), value)
        fh, rep = c.read()
        assert fh.status == 0 and rep["st"] == [Status.CORRUPT]
        # the right checksum commits; the GET reply carries it back
        c.send(encode_frame(Op.PUT, 3, {"ns": b"n", "items": [
            [b"a", 4096, 0, 4096, 0, checksum(value)]]}, 4096), value)
        fh, rep = c.read()
        assert rep["st"] == [Status.OK]
        c.send(encode_frame(Op.GET, 4, {"ns": b"n", "items": [[b"a", 0, 8192, 0]]}))
        fh, rep = c.read()
        st, total, _ver, n, csum = rep["items"][0]
        assert (st, total, n, csum) == (Status.OK, 4096, 4096, checksum(value))
        got = bytearray()
        while len(got) < n:
            got += c.sock.recv(n - len(got))
        assert bytes(got) == value
    # slices of one value must all carry the same checksum
    with RawConn(cluster.addresses[0]) as c:
        c.auth()
        pid = 77
        c.send(encode_frame(Op.PUT, 2, {"ns": b"n", "items": [
            [b"s", 4096, 0, 2048, pid, checksum(value)],
            [b"s", 4096, 2048, 2048, pid, checksum(value) ^ 2]]}, 4096), value)
        fh, rep = c.read()
        assert rep["st"] == [Status.OK, Status.BAD_REQUEST]


@pytest.mark.timeout(60)
def test_tcp_put_frame_mixing_whole_and_sliced_values_refuses_only_the_corrupt_one(cluster):
    """The server hashes a frame's whole values in one batch (``native.checksums``) and
    sliced ones when their last slice lands: each item is checked against its own
    writer's checksum, whatever sits around it in the frame."""
    a, b, s, c2 = (os.urandom(n) for n in (3000, 5000, 4096, 1))
    items = [[b"A", len(a), 0, len(a), 0, checksum(a)],
             [b"S", 4096, 0, 1000, 9, checksum(s)],
             [b"B", len(b), 0, len(b), 0, checksum(b) ^ 4],  # not the bytes sent
             [b"S", 4096, 1000, 3096, 9, checksum(s)],
             [b"C", 1, 0, 1, 0, checksum(c2)]]
    payload = a + s[:1000] + b + s[1000:] + c2
    with RawConn(cluster.addresses[0]) as c:
        c.auth()
        c.send(encode_frame(Op.PUT, 2, {"ns": b"m", "items": items}, len(payload)), payload)
        fh, rep = c.read()
        assert fh.status == 0
        assert rep["st"] == [Status.OK, Status.OK, Status.CORRUPT, Status.OK, Status.OK]
    with Client([cluster.addresses[0]], namespace="m", transport="tcp", timeout_ms=5000) as t:
        assert [t.get(k) for k in (b"A", b"S", b"B", b"C")] == [a, s, None, c2]
