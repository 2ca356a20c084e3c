"""A frame of one item reads its reply through one buffer, with the many-item path's
results and checks.

``TcpTransport._one`` serves every one-item GET, EXISTS, DELETE and TOUCH on plain
TCP: the request in one send, then the prefix, header and (up to the connection's
reply buffer) the value in one ``recv`` after one ``poll`` (``protocol.read_reply_into``);
a longer value lands in its destination straight from the socket.

Pinned here:

* against a real server, its results equal those of the same item read as the first
  item of a two-item frame (the many-item path), field for field, for values around
  and past the buffer's size, byte gets and gets into a destination, whole objects and
  slices, with and without hashing as the bytes land, and for the key ops;
* against scripted hostile servers, every malformed reply (a wrong request id, a bad
  CRC, bytes past the reply, more bytes than asked for, lengths that do not add up, a
  streamed reply nobody asked for, a payload on an EXISTS, a header over the limit,
  EOF mid-value) is a protocol error: the call fails and the connection is closed,
  never a wrong value; and through a ``Client`` the call is a miss;
* a reply whose header is longer than what the buffer reads ahead (a long error
  message, extra header fields) and one arriving a few bytes at a time read whole.
"""

from __future__ import annotations

import os
import socket
import struct
import time
import zlib

import pytest
import xxhash
from hypothesis import HealthCheck, given, settings, strategies as st

from gcache.protocol import (FLAG_MORE, FLAG_RESPONSE, PREFIX, PREFIX_SIZE, Limits, Op,
                             encode_frame, read_frame)
from gcache.sdk import Client, Status
from gcache.sdk.transports.base import GetItem, KeyItem, Work
from gcache.sdk.transports.tcp import ONE_ITEM_BUFFER_BYTES, TcpTransport
from gcache.testing.standin import StandIn

pytestmark = [pytest.mark.integration]

CAP = ONE_ITEM_BUFFER_BYTES
# values around the reply buffer's end (its header takes a few dozen bytes of it)
SIZES = [0, 1, 4096, 64 << 10, CAP - 200, CAP - 60, CAP, CAP + 1, 300 << 10, 1 << 20]
MISSING = b"never-written"


def _transport(address: str) -> TcpTransport:
    t = TcpTransport(address, "", Limits(), 5.0)
    t.connect(time.monotonic() + 5)
    return t


def _run(t: TcpTransport, op: int, items: list, verify: bool = False) -> list:
    return t.execute(Work(op, b"default", items, time.monotonic() + 10, None, verify=verify))


def _fields(r) -> tuple:
    data = None if r.data is None else bytes(r.data)
    return (r.status, r.total_len, r.version, r.nbytes, data, r.checksum, r.landed)


@pytest.fixture(scope="module")
def stored():
    from gcache.testing.cluster import Cluster

    with Cluster(1, "64MiB", slab="2MiB", prefix=f"oneitem{os.getpid()}") as cl:
        values = {b"v%d" % n: os.urandom(n) for n in SIZES}
        with Client(cl.addresses, transport="tcp", timeout_ms=10000) as c:
            for k, v in values.items():
                assert c.put(k, v) == Status.OK
        yield cl.addresses[0], values


@pytest.mark.timeout(120)
@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(size=st.sampled_from(SIZES), into=st.booleans(), verify=st.booleans(),
       cut=st.sampled_from(["whole", "head", "tail", "past"]))
def test_one_item_get_matches_the_many_item_path(stored, size, into, verify, cut):
    address, values = stored
    key, value = b"v%d" % size, values[b"v%d" % size]
    offset, max_len = {"whole": (0, 1 << 20), "head": (0, max(1, size // 2)),
                       "tail": (size // 3, 1 << 20), "past": (size + 5, 100)}[cut]
    want = value[offset:offset + max_len]
    one_dst = bytearray(len(want)) if into else None
    many_dst = bytearray(len(want)) if into else None

    def item(dst, index=0):
        return GetItem(key, offset, max_len, 0, None if dst is None else memoryview(dst),
                       index)

    t = _transport(address)
    try:
        one = _run(t, Op.GET, [item(one_dst)], verify)
        many = _run(t, Op.GET, [item(many_dst), GetItem(MISSING, 0, 64, 0, None, 1)],
                    verify)
        again = _run(t, Op.GET, [item(None)])  # the stream is where it should be
    finally:
        t.close()
    assert len(one) == 1 and len(many) == 2
    assert _fields(one[0]) == _fields(many[0])
    assert many[1].status == Status.MISS
    if cut != "past":
        assert one[0].status == Status.OK and one[0].total_len == size
    if into:
        assert one_dst == many_dst == want
    else:
        assert (one[0].data or b"") == want
    assert bytes(again[0].data or b"") == value[offset:offset + max_len]
    if verify and cut == "whole" and size:
        assert one[0].landed == xxhash.xxh3_64_intdigest(value)


@pytest.mark.timeout(60)
def test_one_item_key_ops_match_the_many_item_path(stored):
    address, values = stored
    t = _transport(address)
    try:
        for op in (Op.EXISTS, Op.TOUCH):
            for key in (b"v1", MISSING):
                one = _run(t, op, [KeyItem(key)])
                many = _run(t, op, [KeyItem(key), KeyItem(b"other", 1)])
                assert _fields(one[0]) == _fields(many[0])
                assert one[0].status == (Status.OK if key in values else Status.MISS)
        put = Client([address], transport="tcp", timeout_ms=10000)
        try:
            assert put.put(b"gone", b"x" * 10) == Status.OK
        finally:
            put.close()
        assert [r.status for r in _run(t, Op.DELETE, [KeyItem(b"gone")])] == [Status.OK]
        assert [r.status for r in _run(t, Op.EXISTS, [KeyItem(b"gone")])] == [Status.MISS]
    finally:
        t.close()


# ---------------------------------------------------------------- hostile servers

def _reply(op: int, rid: int, meta: dict, payload: bytes = b"", flags: int = 0) -> bytes:
    return encode_frame(op, rid, meta, len(payload), flags=FLAG_RESPONSE | flags) + payload


def _bad_crc(frame: bytes) -> bytes:
    return frame[:PREFIX_SIZE] + bytes([frame[PREFIX_SIZE] ^ 1]) + frame[PREFIX_SIZE + 1:]


def _huge_header(op: int, rid: int) -> bytes:
    header = b"\x80"  # an empty map, claimed to be longer than any header may be
    hlen = Limits().max_header_bytes + 1
    fixed = PREFIX.pack(0x31464347, 1, op, FLAG_RESPONSE, rid, 0, 0, hlen, 0, 0)[:32]
    crc = zlib.crc32(header, zlib.crc32(fixed))
    return fixed + struct.pack("<I", crc) + header


V = b"y" * 100
ROW = [0, len(V), 1, len(V), xxhash.xxh3_64_intdigest(V)]

# name -> (op asked, reply bytes given the request id)
HOSTILE = {
    "wrong_request_id": (Op.GET, lambda rid: _reply(Op.GET, rid + 1, {"items": [ROW]}, V)),
    "wrong_opcode": (Op.GET, lambda rid: _reply(Op.EXISTS, rid, {"st": [0]})),
    "bad_crc": (Op.GET, lambda rid: _bad_crc(_reply(Op.GET, rid, {"items": [ROW]}, V))),
    "bytes_past_the_reply": (Op.GET, lambda rid: _reply(Op.GET, rid, {"items": [ROW]}, V)
                             + b"\0" * 64),
    "more_than_asked": (Op.GET, lambda rid: _reply(
        Op.GET, rid, {"items": [[0, 500, 1, 500, 0]]}, b"z" * 500)),
    "lengths_do_not_add_up": (Op.GET, lambda rid: _reply(
        Op.GET, rid, {"items": [[0, 100, 1, 100, 0]]}, b"z" * 60)),
    "two_rows_for_one_item": (Op.GET, lambda rid: _reply(
        Op.GET, rid, {"items": [ROW, ROW]}, V + V)),
    "negative_length": (Op.GET, lambda rid: _reply(
        Op.GET, rid, {"items": [[0, 100, 1, -1, 0]]})),
    "unasked_stream": (Op.GET, lambda rid: _reply(Op.GET, rid, {"items": [ROW]}, V,
                                                  FLAG_MORE)),
    "exists_with_payload": (Op.EXISTS, lambda rid: _reply(Op.EXISTS, rid, {"st": [0]},
                                                          b"p" * 8)),
    "exists_two_statuses": (Op.EXISTS, lambda rid: _reply(Op.EXISTS, rid, {"st": [0, 0]})),
    "header_over_the_limit": (Op.EXISTS, lambda rid: _huge_header(Op.EXISTS, rid)),
    "eof_mid_value": (Op.GET, lambda rid: _reply(Op.GET, rid, {"items": [ROW]}, V)[:-30]),
}


class Scripted(StandIn):
    """Greets, accepts AUTH, then answers each request with ``answer(sock, prefix)``;
    with ``close_after``, closes the connection once the first answer is sent."""

    def __init__(self, answer, close_after: bool = False) -> None:
        self.answer, self.close_after = answer, close_after
        super().__init__()

    def serve(self, c: socket.socket) -> None:
        try:
            c.sendall(encode_frame(Op.HELLO, 0, {"v": 1, "name": "scripted",
                                                 "nonce": b"n" * 16, "auth": False},
                                   flags=FLAG_RESPONSE))
            while True:
                fh, _ = read_frame(c, Limits())
                if fh.opcode == Op.AUTH:
                    c.sendall(_reply(Op.AUTH, fh.request_id, {"ok": True}))
                    continue
                self.answer(c, fh)
                if self.close_after:
                    c.close()
                    return
        except (OSError, ConnectionError):
            pass


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_one_item_replies_fail_the_call_and_close(case):
    op, reply = HOSTILE[case]
    srv = Scripted(lambda c, fh: c.sendall(reply(fh.request_id)),
                   close_after=case == "eof_mid_value")
    try:
        t = _transport(srv.address)
        item = GetItem(b"k", 0, 256, 0, None) if op == Op.GET else KeyItem(b"k")
        with pytest.raises(ConnectionError):
            _run(t, op, [item])
        assert t.sock is None, "the connection of a malformed reply stays open"
        with Client([srv.address], transport="tcp", timeout_ms=2000) as c:
            t0 = time.monotonic()
            got = c.get(b"k") if op == Op.GET else c.exists(b"k")
            assert got in (None, False), f"{case}: a malformed reply read as {got!r}"
            assert time.monotonic() - t0 < 2.0 + 0.5
    finally:
        srv.close()


@pytest.mark.timeout(60)
def test_a_reply_in_many_small_pieces_reads_whole():
    """The buffered read assembles a reply whatever the segments: prefix, header and
    value arriving a few bytes at a time still give the exact value."""
    value = bytes(range(256)) * 40

    def answer(c: socket.socket, fh) -> None:
        row = [0, len(value), 1, len(value), xxhash.xxh3_64_intdigest(value)]
        frame = _reply(Op.GET, fh.request_id, {"items": [row]}, value)
        for i in range(0, len(frame), 7):
            c.sendall(frame[i:i + 7])
            if i < 200:
                time.sleep(0.0005)

    srv = Scripted(answer)
    try:
        t = _transport(srv.address)
        try:
            for _ in range(3):  # the connection stays usable after each
                r = _run(t, Op.GET, [GetItem(b"k", 0, 1 << 20, 0, None)], verify=True)[0]
                assert r.status == Status.OK and r.data == value
                assert r.landed == xxhash.xxh3_64_intdigest(value)
        finally:
            t.close()
    finally:
        srv.close()


LONG_VALUE = bytes(range(256)) * 8


def _long_headers(c: socket.socket, fh) -> None:
    """A GET's value under a header padded past the read-ahead (a byte get's: past the
    whole buffer); anything else a frame-level error whose message is longer than the
    whole buffer."""
    if fh.opcode == Op.GET:
        v = LONG_VALUE
        row = [0, len(v), 1, len(v), xxhash.xxh3_64_intdigest(v)]
        c.sendall(_reply(Op.GET, fh.request_id, {"items": [row], "pad": "p" * (CAP + 500)},
                         v))
    else:
        c.sendall(encode_frame(fh.opcode, fh.request_id, {"error": "e" * (CAP + 100)},
                               flags=FLAG_RESPONSE, status=Status.BAD_REQUEST))


@pytest.mark.timeout(60)
def test_headers_longer_than_the_read_ahead_read_whole():
    srv = Scripted(_long_headers)
    try:
        t = _transport(srv.address)
        try:
            v = LONG_VALUE
            for into in (False, True, False):  # the stream stays in step after each
                dst = bytearray(len(v)) if into else None
                item = GetItem(b"k", 0, 1 << 20, 0, None if dst is None else memoryview(dst))
                r = _run(t, Op.GET, [item])[0]
                assert r.status == Status.OK and r.nbytes == len(v)
                assert (dst if into else r.data) == v
            r = _run(t, Op.EXISTS, [KeyItem(b"k")])[0]
            assert r.status == Status.BAD_REQUEST
            assert t.sock is None  # a frame-level error ends the connection
        finally:
            t.close()
    finally:
        srv.close()
