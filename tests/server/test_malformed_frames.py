"""A real gcache-server against hand-made malformed frames.

Every case speaks the protocol by hand over a raw socket (rawwire.RawConn) and
checks the three promises of the framing layer:

1. a frame the server can attribute gets an error reply with the right non-zero
   status (and the request's id once the frame itself parsed), a frame it
   cannot attribute (truncation) gets none;
2. the server closes the connection afterwards, so a bad stream can never
   desynchronise;
3. the server survives and keeps serving: a fresh SDK client round-trips a
   value after each case, and the server logged no traceback.

Plus: a truncated put is never readable, and stalled oversize claims do not
cost the server memory.
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass
from typing import Callable

import msgpack
import pytest

from gcache.protocol import FLAG_RESPONSE, PREFIX_SIZE, Op, encode_frame
from gcache.sdk import Client
from gcache.status import Status

from rawwire import (ANY_RID, LIM, RawConn, assert_serving, raw_frame, rss_bytes,
                     server_log)

pytestmark = [pytest.mark.integration, pytest.mark.faults]

RID = 0x1234_5678_9ABC
NS = b"mal"
MIB = 1 << 20


def _get(key: bytes = b"k", ns: bytes = NS) -> dict:
    return {"ns": ns, "items": [[key, 0, 1024, 0]]}


def _put(key: bytes, n: int, ns: bytes = NS) -> dict:
    return {"ns": ns, "items": [[key, n, 0, n, 0]]}


@dataclass(frozen=True)
class Case:
    id: str
    auth: bool  # authenticate before sending
    send: Callable[[RawConn], None]
    status: int | None  # expected error status; None = no reply, the server just closes
    rid: object = RID  # expected request id of the reply (ANY_RID: frame never parsed)


def _flip_last(frame: bytes) -> bytes:
    b = bytearray(frame)
    b[-1] ^= 0x01
    return bytes(b)


CASES = [
    # -------- frame level: the prefix or header itself is bad (reply carries no request id)
    Case("bad-magic", True,
         lambda c: c.send(raw_frame(Op.GET, RID, _get(), magic=0x50545448)),
         Status.BAD_REQUEST, ANY_RID),
    Case("wrong-version", True,
         lambda c: c.send(raw_frame(Op.GET, RID, _get(), version=2)),
         Status.BAD_REQUEST, ANY_RID),
    Case("header-crc-mismatch", True,
         lambda c: c.send(_flip_last(encode_frame(Op.GET, RID, _get()))),
         Status.BAD_REQUEST, ANY_RID),
    Case("prefix-crc-mismatch", True,  # a corrupted request id is caught by the CRC too
         lambda c: c.send(raw_frame(Op.GET, RID, _get(), crc=0)),
         Status.BAD_REQUEST, ANY_RID),
    Case("header-len-huge", True,  # only the prefix is sent: must not wait for 4 MiB
         lambda c: c.send(raw_frame(Op.GET, RID, b"", hlen=LIM.max_header_bytes + 1)),
         Status.TOO_LARGE, ANY_RID),
    Case("header-len-u32-max", False,
         lambda c: c.send(raw_frame(Op.AUTH, RID, b"", hlen=2**32 - 1)),
         Status.TOO_LARGE, ANY_RID),
    Case("payload-len-2^60", True,
         lambda c: c.send(raw_frame(Op.PUT, RID, _put(b"k", 10), plen=2**60)),
         Status.TOO_LARGE, ANY_RID),
    Case("payload-len-just-over-max-frame", True,
         lambda c: c.send(raw_frame(Op.PUT, RID, _put(b"k", 10),
                                    plen=LIM.max_frame_bytes + 1)),
         Status.TOO_LARGE, ANY_RID),
    Case("undecodable-msgpack-header", True,
         lambda c: c.send(raw_frame(Op.GET, RID, b"\xc1\xc1\xc1")),
         Status.BAD_REQUEST, ANY_RID),
    Case("msgpack-header-with-trailing-bytes", True,
         lambda c: c.send(raw_frame(Op.GET, RID, msgpack.packb(_get()) + b"\x00")),
         Status.BAD_REQUEST, ANY_RID),
    Case("too-deeply-nested-header", True,
         lambda c: c.send(raw_frame(Op.GET, RID, b"\x91" * 5000 + b"\xc0")),
         Status.BAD_REQUEST, ANY_RID),
    Case("empty-header", True,
         lambda c: c.send(raw_frame(Op.EXISTS, RID, b"")),
         Status.BAD_REQUEST, ANY_RID),
    Case("garbage-after-auth", True,
         lambda c: c.send(b"GET / HTTP/1.1\r\nHost: gcache\r\nAccept: */*\r\n\r\n"),
         Status.BAD_REQUEST, ANY_RID),
    Case("garbage-before-auth", False,
         lambda c: c.send(os.urandom(4096).replace(b"GCF1", b"XXXX")),
         Status.BAD_REQUEST, ANY_RID),
    # -------- truncation: nothing to attribute, the server just closes
    Case("truncated-prefix", True,
         lambda c: (c.send(encode_frame(Op.GET, RID, _get())[:20]), c.half_close()),
         None),
    Case("truncated-header", True,
         lambda c: (c.send(encode_frame(Op.GET, RID, _get())[:PREFIX_SIZE + 5]),
                    c.half_close()),
         None),
    Case("truncated-auth", False,
         lambda c: (c.send(encode_frame(Op.AUTH, RID, {"mac": b""})[:-2]), c.half_close()),
         None),
    Case("eof-right-after-hello", False, lambda c: c.half_close(), None),
    # -------- op level: the frame parsed, the request is bad (reply echoes the request id)
    Case("header-not-a-map-put", True,
         lambda c: c.send(encode_frame(Op.PUT, RID, [b"k", 1, 0, 1, 0], 0)),
         Status.BAD_REQUEST),
    Case("header-not-a-map-get", True,
         lambda c: c.send(encode_frame(Op.GET, RID, [[b"k", 0, 10, 0]])),
         Status.BAD_REQUEST),
    Case("header-not-a-map-exists", True,
         lambda c: c.send(encode_frame(Op.EXISTS, RID, b"k")),
         Status.BAD_REQUEST),
    Case("header-not-a-map-delete", True,
         lambda c: c.send(encode_frame(Op.DELETE, RID, 7)),
         Status.BAD_REQUEST),
    Case("items-not-a-list", True,
         lambda c: c.send(encode_frame(Op.TOUCH, RID, {"ns": NS, "items": b"k"})),
         Status.BAD_REQUEST),
    Case("put-lengths-dont-add-up", True,
         lambda c: c.send(encode_frame(Op.PUT, RID, {"ns": NS, "items": [
             [b"a", 100, 0, 100, 0], [b"b", 50, 0, 50, 0]]}, 200), b"x" * 200),
         Status.BAD_REQUEST),
    Case("put-offset-plus-length-over-total", True,
         lambda c: c.send(encode_frame(Op.PUT, RID, {"ns": NS, "items": [
             [b"a", 10, 5, 10, 1]]}, 10), b"y" * 10),
         Status.BAD_REQUEST),
    Case("put-negative-length", True,
         lambda c: c.send(encode_frame(Op.PUT, RID, {"ns": NS, "items": [
             [b"a", 10, 0, -1, 0]]}, 0)),
         Status.BAD_REQUEST),
    Case("put-item-wrong-arity", True,
         lambda c: c.send(encode_frame(Op.PUT, RID, {"ns": NS, "items": [[b"a", 4, 0, 4]]}, 4),
                          b"zzzz"),
         Status.BAD_REQUEST),
    # the placement hashes a put stores with its objects: checked even without masters
    Case("put-ph-wrong-length", True,
         lambda c: c.send(encode_frame(Op.PUT, RID, {**_put(b"a", 4), "ph": [1, 2]}, 4),
                          b"zzzz"),
         Status.BAD_REQUEST),
    Case("put-ph-not-an-int", True,
         lambda c: c.send(encode_frame(Op.PUT, RID, {**_put(b"a", 4), "ph": [b"x"]}, 4),
                          b"zzzz"),
         Status.BAD_REQUEST),
    Case("put-ph-negative", True,
         lambda c: c.send(encode_frame(Op.PUT, RID, {**_put(b"a", 4), "ph": [-1]}, 4),
                          b"zzzz"),
         Status.BAD_REQUEST),
    # the chain parent ("ch") of a put frame: bytes of at most max_key_bytes, else refused
    Case("put-ch-not-bytes", True,
         lambda c: c.send(encode_frame(Op.PUT, RID, {**_put(b"a", 4), "ch": 7}, 4), b"zzzz"),
         Status.BAD_REQUEST),
    Case("put-ch-a-list", True,
         lambda c: c.send(encode_frame(Op.PUT, RID, {**_put(b"a", 4), "ch": [b"p"]}, 4),
                          b"zzzz"),
         Status.BAD_REQUEST),
    Case("put-ch-over-max-key-bytes", True,
         lambda c: c.send(encode_frame(Op.PUT, RID, {**_put(b"a", 4),
                                                     "ch": b"p" * (LIM.max_key_bytes + 1)}, 4),
                          b"zzzz"),
         Status.TOO_LARGE),
    Case("put-staged-ch-not-bytes", True,
         lambda c: c.send(encode_frame(Op.PUT_STAGED, RID, {
             "ns": NS, "stage": "x", "skey": b"k" * 16, "items": [[b"k", 4, 0, 4, 1, 0]],
             "ch": "text"})),
         Status.BAD_REQUEST),
    Case("get-item-wrong-arity", True,
         lambda c: c.send(encode_frame(Op.GET, RID, {"ns": NS, "items": [[b"k", 0, 10]]})),
         Status.BAD_REQUEST),
    Case("get-item-non-int-field", True,
         lambda c: c.send(encode_frame(Op.GET, RID, {"ns": NS, "items": [[b"k", 0, "10", 0]]})),
         Status.BAD_REQUEST),
    Case("get-with-payload", True,
         lambda c: c.send(encode_frame(Op.GET, RID, _get(), 16), b"p" * 16),
         Status.BAD_REQUEST),
    Case("str-key", True,
         lambda c: c.send(encode_frame(Op.EXISTS, RID, {"ns": NS, "items": ["k"]})),
         Status.BAD_REQUEST),
    Case("empty-key", True,
         lambda c: c.send(encode_frame(Op.EXISTS, RID, {"ns": NS, "items": [b""]})),
         Status.BAD_REQUEST),
    Case("unknown-opcode", True,
         lambda c: c.send(encode_frame(99, RID, {"ns": NS, "items": []})),
         Status.BAD_REQUEST),
    Case("hello-from-client", True,
         lambda c: c.send(encode_frame(Op.HELLO, RID, {})),
         Status.BAD_REQUEST),
    Case("data-op-before-auth", False,
         lambda c: c.send(encode_frame(Op.PUT, RID, _put(b"k", 64), 64), b"v" * 64),
         Status.AUTH),
    Case("stats-before-auth", False,
         lambda c: c.send(encode_frame(Op.STATS, RID, {})),
         Status.AUTH),
    Case("unknown-opcode-before-auth", False,
         lambda c: c.send(encode_frame(77, RID, {})),
         Status.AUTH),
    Case("auth-with-payload", False,
         lambda c: c.send(encode_frame(Op.AUTH, RID, {"mac": b""}, 8), b"12345678"),
         Status.BAD_REQUEST),
    Case("response-flagged-frame", True,
         lambda c: c.send(encode_frame(Op.GET, RID, _get(), flags=FLAG_RESPONSE)),
         Status.BAD_REQUEST),
    Case("response-flagged-frame-before-auth", False,
         lambda c: c.send(encode_frame(Op.AUTH, RID, {"mac": b""}, flags=FLAG_RESPONSE)),
         Status.BAD_REQUEST),
    Case("key-too-long-get", True,
         lambda c: c.send(encode_frame(Op.GET, RID, _get(b"k" * (LIM.max_key_bytes + 1)))),
         Status.TOO_LARGE),
    Case("key-too-long-put", True,
         lambda c: c.send(encode_frame(Op.PUT, RID, _put(b"k" * (LIM.max_key_bytes + 1), 32),
                                       32), b"v" * 32),
         Status.TOO_LARGE),
    Case("namespace-too-long", True,
         lambda c: c.send(encode_frame(Op.EXISTS, RID, {
             "ns": b"n" * (LIM.max_namespace_bytes + 1), "items": [b"k"]})),
         Status.TOO_LARGE),
    Case("namespace-not-bytes", True,
         lambda c: c.send(encode_frame(Op.GET, RID, {"ns": 5, "items": [[b"k", 0, 1, 0]]})),
         Status.BAD_REQUEST),
    Case("too-many-items", True,
         lambda c: c.send(encode_frame(Op.EXISTS, RID, {
             "ns": NS, "items": [b"k%d" % i for i in range(LIM.max_batch_items + 1)]})),
         Status.TOO_LARGE),
    # -------- shm / nixl control ops (LEASE, RELEASE, ALLOC, COMMIT, PUT_STAGED)
    Case("lease-before-auth", False,
         lambda c: c.send(encode_frame(Op.LEASE, RID, {"ns": NS, "items": [[b"k", 0]]})),
         Status.AUTH),
    Case("lease-header-not-a-map", True,
         lambda c: c.send(encode_frame(Op.LEASE, RID, [b"k"])), Status.BAD_REQUEST),
    Case("lease-item-wrong-arity", True,
         lambda c: c.send(encode_frame(Op.LEASE, RID, {"ns": NS, "items": [[b"k", 0, 1]]})),
         Status.BAD_REQUEST),
    Case("lease-negative-version", True,
         lambda c: c.send(encode_frame(Op.LEASE, RID, {"ns": NS, "items": [[b"k", -1]]})),
         Status.BAD_REQUEST),
    Case("lease-with-payload", True,
         lambda c: c.send(encode_frame(Op.LEASE, RID, {"ns": NS, "items": [[b"k", 0]]}, 4),
                          b"junk"),
         Status.BAD_REQUEST),
    Case("release-ids-not-a-list", True,
         lambda c: c.send(encode_frame(Op.RELEASE, RID, {"leases": 7})), Status.BAD_REQUEST),
    Case("release-id-not-an-int", True,
         lambda c: c.send(encode_frame(Op.RELEASE, RID, {"leases": [b"1"]})),
         Status.BAD_REQUEST),
    Case("release-too-many-ids", True,
         lambda c: c.send(encode_frame(Op.RELEASE, RID, {
             "leases": list(range(LIM.max_batch_items + 1))})),
         Status.TOO_LARGE),
    Case("alloc-item-wrong-arity", True,
         lambda c: c.send(encode_frame(Op.ALLOC, RID, {"ns": NS, "items": [[b"k", 8, 0]]})),
         Status.BAD_REQUEST),
    Case("alloc-offset-plus-length-over-total", True,
         lambda c: c.send(encode_frame(Op.ALLOC, RID, {"ns": NS, "items": [[b"k", 8, 4, 8, 1]]})),
         Status.BAD_REQUEST),
    Case("put-staged-item-without-checksum", True,
         lambda c: c.send(encode_frame(Op.PUT_STAGED, RID, {
             "ns": NS, "stage": "x", "skey": b"k" * 16, "items": [[b"k", 8, 0, 8, 1]]})),
         Status.BAD_REQUEST),
    Case("put-staged-with-payload", True,
         lambda c: c.send(encode_frame(Op.PUT_STAGED, RID, {
             "ns": NS, "stage": "x", "skey": b"k" * 16, "items": [[b"k", 4, 0, 4, 1, 0]]}, 4),
             b"junk"),
         Status.BAD_REQUEST),
    Case("commit-slots-not-a-list", True,
         lambda c: c.send(encode_frame(Op.COMMIT, RID, {"slots": {}, "abort": []})),
         Status.BAD_REQUEST),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_malformed_frame(cluster, case: Case):
    addr = cluster.addresses[0]
    with RawConn(addr) as conn:
        if case.auth:
            conn.auth()
        case.send(conn)
        if case.status is not None:
            msg = conn.expect_error(case.status, case.rid)
            assert len(msg) < 1000
        conn.expect_closed()
    assert_serving(cluster)
    log = server_log(cluster)
    assert "Traceback" not in log, log[-3000:]


# ---------------------------------------------------------------- the reply is not lost

BIG = 8 * MIB  # far more than the socket buffers hold: the sender is mid-payload when refused

REFUSED_MID_PAYLOAD = [
    Case("data-op-before-auth-8MiB", False,
         lambda c: c.send(encode_frame(Op.PUT, RID, _put(b"k", BIG), BIG), bytes(BIG)),
         Status.AUTH),
    Case("key-too-long-put-8MiB", True,
         lambda c: c.send(encode_frame(Op.PUT, RID, _put(b"k" * (LIM.max_key_bytes + 1), BIG),
                                       BIG), bytes(BIG)),
         Status.TOO_LARGE),
    Case("put-lengths-dont-add-up-8MiB", True,
         lambda c: c.send(encode_frame(Op.PUT, RID, _put(b"k", 5), BIG), bytes(BIG)),
         Status.BAD_REQUEST),
    Case("bad-magic-then-8MiB", True,
         lambda c: c.send(raw_frame(Op.PUT, RID, _put(b"k", BIG), BIG, magic=1), bytes(BIG)),
         Status.BAD_REQUEST, ANY_RID),
]


@pytest.mark.parametrize("case", REFUSED_MID_PAYLOAD, ids=[c.id for c in REFUSED_MID_PAYLOAD])
def test_error_reply_survives_unread_input(cluster, case: Case):
    """The server refuses a frame before reading its payload. The peer must still be able
    to finish sending and then read the error reply, even when it reads late: a close with
    unread input would RST the connection and destroy the reply (and the SDK would report
    UNAVAILABLE and mark a healthy server suspect instead of seeing the real status)."""
    with RawConn(cluster.addresses[0]) as conn:
        if case.auth:
            conn.auth()
        case.send(conn)  # ConnectionResetError here = the server reset mid-payload
        time.sleep(0.3)  # a slow reader: the reply must still be there
        conn.expect_error(case.status, case.rid)
        conn.expect_closed()
    assert_serving(cluster)


# ---------------------------------------------------------------- stream stays in sync

def test_good_frames_after_per_item_faults_stay_in_sync(cluster):
    """Per-item faults (too large, miss) are statuses inside a normal reply; the stream
    goes on: a refused item's payload is drained, and the next frame parses."""
    with RawConn(cluster.addresses[0]) as conn:
        conn.auth()
        big = LIM.max_value_bytes  # far over this server's 1 MiB slab
        meta = {"ns": NS, "items": [[b"huge", big, 0, 3000, 9], [b"ok", 5, 0, 5, 0]]}
        conn.send(encode_frame(Op.PUT, 7, meta, 3005), b"h" * 3000, b"hello")
        fh, rep = conn.read()
        assert (fh.request_id, fh.status, rep["st"]) == (7, 0, [Status.TOO_LARGE, Status.OK])
        conn.send(encode_frame(Op.GET, 8, {"ns": NS, "items": [[b"ok", 0, 100, 0],
                                                                [b"nope", 0, 100, 0]]}))
        fh, rep = conn.read()
        assert fh.request_id == 8 and rep["items"][0][0] == Status.OK
        assert rep["items"][1][0] == Status.MISS
        assert conn.sock.recv(fh.payload_len, socket.MSG_WAITALL) == b"hello"
        conn.send(encode_frame(Op.PING, 9, {}))
        fh, _ = conn.read()
        assert fh.request_id == 9 and fh.status == 0


# ---------------------------------------------------------------- truncated puts

def _wait_stats(client: Client, pred, timeout: float = 5.0) -> dict:
    end = time.monotonic() + timeout
    while True:
        (s,) = client.stats().values()
        if pred(s) or time.monotonic() > end:
            return s
        time.sleep(0.05)


@pytest.mark.parametrize("existing", [False, True], ids=["fresh-key", "overwrite"])
def test_truncated_put_payload_is_never_readable(cluster, existing):
    key, value = b"trunc-key", os.urandom(300_000)
    old = os.urandom(1000)
    with Client(servers=cluster.addresses, namespace=NS, timeout_ms=3000) as c:
        if existing:
            assert c.put(key, old) == Status.OK
        base = _wait_stats(c, lambda s: True)["used_bytes"]
        with RawConn(cluster.addresses[0]) as conn:
            conn.auth()
            conn.send(encode_frame(Op.PUT, RID, _put(key, len(value)), len(value)),
                      value[:len(value) // 2])
            conn.half_close()
            conn.expect_closed()
        s = _wait_stats(c, lambda s: s["used_bytes"] == base)
        assert s["used_bytes"] == base, s  # the reserved chunk was given back
        assert s["pending_puts"] == 0
        if existing:
            assert c.get(key) == old  # the old value survives, never a torn new one
        else:
            assert c.get(key) is None
            assert not c.exists(key)
        assert c.put(key, value) == Status.OK
        assert c.get(key) == value
    assert_serving(cluster)


def test_truncated_second_slice_of_sliced_put(cluster):
    """Slice 1 of 2 arrives whole (acknowledged, uncommitted), slice 2 is cut off: the
    object must never become readable and its chunk must be reclaimed."""
    key, value = b"sliced", os.urandom(200_000)
    half, pid = len(value) // 2, 0x5EED
    with RawConn(cluster.addresses[0]) as conn:
        conn.auth()
        meta = {"ns": NS, "items": [[key, len(value), 0, half, pid]]}
        conn.send(encode_frame(Op.PUT, 1, meta, half), value[:half])
        fh, rep = conn.read()
        assert rep["st"] == [Status.OK]
        meta = {"ns": NS, "items": [[key, len(value), half, len(value) - half, pid]]}
        conn.send(encode_frame(Op.PUT, 2, meta, len(value) - half), value[half:half + 10])
        conn.half_close()
        conn.expect_closed()
    with Client(servers=cluster.addresses, namespace=NS, timeout_ms=3000) as c:
        s = _wait_stats(c, lambda s: s["used_bytes"] == 0 and s["pending_puts"] == 0)
        assert (s["used_bytes"], s["pending_puts"]) == (0, 0), s
        assert c.get(key) is None
        assert c.put(key, value) == Status.OK
        assert c.get(key) == value


# ---------------------------------------------------------------- memory bound

def test_stalled_oversize_claims_do_not_cost_memory(cluster):
    """200 connections each claim a 3 MiB header or a 256 MiB payload, send a few bytes
    and stall, then close. Lengths under the limits are legal, but the server must not
    allocate for bytes it has not received: RSS stays flat (the arena is prefaulted at
    start, so only growth counts)."""
    addr = cluster.addresses[0]
    pid = cluster.servers[0].proc.pid
    assert_serving(cluster)  # warm up the code paths once
    with Client(servers=[addr], namespace=NS, timeout_ms=3000) as c:
        used0 = _wait_stats(c, lambda s: True)["used_bytes"]
    base = rss_bytes(pid)
    conns: list[RawConn] = []
    try:
        for i in range(200):
            conn = RawConn(addr)
            conns.append(conn)
            kind = i % 4
            if kind == 0:  # unauthenticated, 3 MiB header claimed, 1 byte of it sent
                conn.send(raw_frame(Op.AUTH, i, b"", hlen=3 * MIB)[:PREFIX_SIZE], b"\x81")
            elif kind == 1:  # authenticated, same
                conn.auth()
                conn.send(raw_frame(Op.GET, i, b"", hlen=3 * MIB)[:PREFIX_SIZE])
            elif kind == 2:  # authenticated put of a 256 MiB (too large) value, stalled
                conn.auth()
                n = 256 * MIB
                conn.send(encode_frame(Op.PUT, i, _put(b"big%d" % i, n), n), b"x" * 1000)
            else:  # authenticated put of 512 fitting values, 256 MiB in all, stalled
                conn.auth()
                items = [[b"v%d-%d" % (i, j), 512 << 10, 0, 512 << 10, 0] for j in range(512)]
                conn.send(encode_frame(Op.PUT, i, {"ns": NS, "items": items}, 256 * MIB),
                          b"y" * 1000)
        time.sleep(1.0)
        assert cluster.servers[0].alive
        stalled = rss_bytes(pid)
    finally:
        for conn in conns:
            conn.close()
    after = rss_bytes(pid)
    end = time.monotonic() + 5
    while after - base > 64 * MIB and time.monotonic() < end:
        time.sleep(0.1)
        after = rss_bytes(pid)
    grew_stalled, grew_after = (stalled - base) / MIB, (after - base) / MIB
    assert grew_stalled < 64, f"RSS grew {grew_stalled:.0f} MiB while 200 claims stalled"
    assert grew_after < 64, f"RSS grew {grew_after:.0f} MiB after the abuse"
    assert_serving(cluster)
    with Client(servers=[addr], namespace=NS, timeout_ms=3000) as c:
        s = _wait_stats(c, lambda s: s["used_bytes"] <= used0 + 64 * 1024)
    # every chunk reserved by a stalled put came back (only the new 4 KiB probe remains)
    assert s["used_bytes"] <= used0 + 64 * 1024, s
    assert s["pending_puts"] == 0, s
