"""Wire protocol v1 framing: round trips, corruption, limits and socket helpers.

Pure in-process tests of ``gcache.protocol``: ``encode_frame`` /
``decode_prefix`` / ``check_crc`` / ``decode_meta`` round trips over random
opcodes, ids, flags, statuses and nested metas; any flipped bit in the CRC span
(prefix[:32] + header) or in the CRC itself is rejected with ``ProtocolError``;
oversize lengths are rejected from the prefix alone, before a byte of header is
read; ``sendmsg_all`` / ``recv_exact_into`` move many buffers intact across
partial writes (both kernel-made, over a real socketpair, and injected).
"""

from __future__ import annotations

import array
import random
import socket
import struct
import threading
import zlib

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gcache.errors import ProtocolError
from gcache.protocol import (FLAG_RESPONSE, MAGIC, PREFIX, PREFIX_SIZE, VERSION, Limits,
                             check_crc, decode_meta, decode_prefix, encode_frame, read_frame,
                             recv_exact, recv_exact_into, sendmsg_all)
from gcache.status import Status

pytestmark = pytest.mark.unit

FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
FEW = settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
LIM = Limits()

u8 = st.integers(0, 2**8 - 1)
u16 = st.integers(0, 2**16 - 1)
u64 = st.integers(0, 2**64 - 1)
plen_st = st.integers(0, LIM.max_frame_bytes)

# Scalars msgpack round-trips exactly (no floats: NaN != NaN; no str/bytes mixing).
scalar = st.one_of(
    st.none(), st.booleans(),
    st.integers(-(2**63), 2**63 - 1), st.integers(2**63, 2**64 - 1),
    st.binary(max_size=64), st.text(max_size=32),
)
meta_st = st.recursive(
    scalar,
    lambda kids: st.one_of(
        st.lists(kids, max_size=6),
        st.dictionaries(st.one_of(st.text(max_size=12), st.binary(max_size=12),
                                  st.integers(0, 2**63 - 1)), kids, max_size=6),
    ),
    max_leaves=40,
)
# The shapes the protocol actually carries: items of [key, ints...] under bytes/str keys.
item_st = st.tuples(st.binary(min_size=1, max_size=LIM.max_key_bytes),
                    st.lists(st.integers(0, 2**63 - 1), min_size=3, max_size=4)
                    ).map(lambda t: [t[0], *t[1]])
request_meta_st = st.fixed_dictionaries({"ns": st.binary(max_size=LIM.max_namespace_bytes),
                                         "items": st.lists(item_st, max_size=8)})


def _decode(frame: bytes, limits: Limits = LIM):
    fh = decode_prefix(frame[:PREFIX_SIZE], limits)
    header = frame[PREFIX_SIZE:PREFIX_SIZE + fh.header_len]
    check_crc(frame[:PREFIX_SIZE], header)
    return fh, decode_meta(header)


def _frame_with(frame: bytes, **fields: int) -> bytearray:
    """Rewrite prefix fields (keeping the old CRC unless crc= is given)."""
    names = ["magic", "version", "opcode", "flags", "rid", "status", "reserved", "hlen",
             "plen", "crc"]
    vals = dict(zip(names, PREFIX.unpack(frame[:PREFIX_SIZE])))
    vals.update(fields)
    return bytearray(PREFIX.pack(*(vals[n] for n in names)) + frame[PREFIX_SIZE:])


# ---------------------------------------------------------------- round trips

@FAST
@given(op=u8, rid=u64, flags=u16, status=u16, plen=plen_st, meta=meta_st)
def test_encode_decode_round_trip(op, rid, flags, status, plen, meta):
    frame = encode_frame(op, rid, meta, plen, flags=flags, status=status)
    fh, got = _decode(frame)
    assert (fh.opcode, fh.request_id, fh.flags, fh.status, fh.payload_len) == (
        op, rid, flags, status, plen)
    assert fh.header_len == len(frame) - PREFIX_SIZE
    assert fh.is_response == bool(flags & FLAG_RESPONSE)
    assert got == meta


@FAST
@given(op=u8, rid=u64, meta=request_meta_st)
def test_request_shaped_meta_round_trip(op, rid, meta):
    fh, got = _decode(encode_frame(op, rid, meta))
    assert got == meta
    assert all(isinstance(it[0], bytes) for it in got["items"])  # bytes stay bytes


def test_prefix_layout_is_wire_stable():
    frame = encode_frame(11, 0x0102030405060708, {"a": 1}, 77, flags=FLAG_RESPONSE, status=6)
    assert PREFIX_SIZE == 36
    assert frame[:4] == b"GCF1"
    magic, ver, op, flags, rid, stat, res, hlen, plen, crc = struct.unpack("<IBBHQHHIQI",
                                                                           frame[:36])
    assert (magic, ver, op, flags, rid, stat, res, plen) == (
        MAGIC, VERSION, 11, FLAG_RESPONSE, 0x0102030405060708, 6, 0, 77)
    header = frame[36:]
    assert hlen == len(header) and msgpack.unpackb(header) == {"a": 1}
    assert crc == zlib.crc32(frame[:32] + header)


def test_max_values_of_every_field():
    frame = encode_frame(255, 2**64 - 1, {b"k": [2**63 - 1, 2**64 - 1, -(2**63)]},
                         LIM.max_frame_bytes, flags=0xFFFF, status=0xFFFF)
    fh, meta = _decode(frame)
    assert fh.request_id == 2**64 - 1 and fh.flags == 0xFFFF and fh.status == 0xFFFF
    assert fh.payload_len == LIM.max_frame_bytes
    assert meta == {b"k": [2**63 - 1, 2**64 - 1, -(2**63)]}


# ---------------------------------------------------------------- corruption

def _rejected(data: bytes | bytearray, limits: Limits = LIM) -> ProtocolError:
    """Decode like a stream reader would: the header is the next header_len bytes, and
    the stream continues past the frame with arbitrary bytes (zeros here)."""
    with pytest.raises(ProtocolError) as ei:
        fh = decode_prefix(data[:PREFIX_SIZE], limits)
        header = bytes(data[PREFIX_SIZE:PREFIX_SIZE + fh.header_len])
        header += bytes(fh.header_len - len(header))
        check_crc(data[:PREFIX_SIZE], header)
        decode_meta(header)
    return ei.value


@FAST
@given(op=u8, rid=u64, flags=u16, status=u16, plen=st.integers(0, 1 << 20),
       meta=meta_st, data=st.data())
def test_any_flipped_bit_is_rejected(op, rid, flags, status, plen, meta, data):
    frame = bytearray(encode_frame(op, rid, meta, plen, flags=flags, status=status))
    # prefix[:32], the CRC field itself, or anywhere in the header
    bit = data.draw(st.integers(0, len(frame) * 8 - 1), label="bit")
    frame[bit // 8] ^= 1 << (bit % 8)
    exc = _rejected(frame)
    assert exc.status in (Status.BAD_REQUEST, Status.TOO_LARGE)


@pytest.mark.parametrize("field,value,words", [
    ("magic", 0x31464348, "magic"),
    ("magic", 0, "magic"),
    ("version", 0, "version"),
    ("version", 2, "version"),
    ("hlen", LIM.max_header_bytes + 1, "max_header_bytes"),
    ("hlen", 2**32 - 1, "max_header_bytes"),
    ("plen", LIM.max_frame_bytes + 1, "max_frame_bytes"),
    ("plen", 2**60, "max_frame_bytes"),
    ("plen", 2**64 - 1, "max_frame_bytes"),
])
def test_prefix_field_rejections(field, value, words):
    frame = encode_frame(10, 5, {"items": []})
    exc = _rejected(_frame_with(frame, **{field: value}))
    assert words in str(exc)
    if field in ("hlen", "plen"):
        assert exc.status == Status.TOO_LARGE
    else:
        assert exc.status == Status.BAD_REQUEST


def test_truncated_prefix_is_rejected():
    frame = encode_frame(3, 1, {})
    for n in (0, 1, 35, 37):
        with pytest.raises(ProtocolError, match="truncated"):
            decode_prefix(frame[:n] if n <= 36 else frame[:36] + b"x", LIM)


def test_reserved_and_crc_fields_are_covered():
    frame = encode_frame(11, 9, {"items": []})
    assert "CRC" in str(_rejected(_frame_with(frame, reserved=1)))
    crc = PREFIX.unpack(frame[:36])[-1]
    assert "CRC" in str(_rejected(_frame_with(frame, crc=crc ^ 0x80000000)))


def test_custom_limits_are_inclusive_bounds():
    lim = Limits(max_header_bytes=100, max_frame_bytes=1000)
    meta = {"x": b"y" * 80}
    ok = encode_frame(1, 1, meta, 1000)
    hlen = len(ok) - PREFIX_SIZE
    assert hlen <= 100
    _decode(ok, lim)  # exactly at the bound is fine
    assert _rejected(encode_frame(1, 1, meta, 1001), lim).status == Status.TOO_LARGE
    assert _rejected(encode_frame(1, 1, {"x": b"y" * 120}), lim).status == Status.TOO_LARGE


@pytest.mark.parametrize("header", [
    b"", b"\xc1", b"\x92\x01", b"\xda\xff\xff", b"\x81\xa1k", b"\x01\x02",
    b"\x91" * 5000 + b"\xc0",
], ids=["empty", "never-used", "short-array", "short-str", "map-no-value", "extra-data",
        "too-deep"])
def test_undecodable_header(header):
    with pytest.raises(ProtocolError):
        decode_meta(header)


# ---------------------------------------------------------------- limits before reading

class _CountingSock:
    """Wraps a socket and records every byte handed to the caller."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock, self.read = sock, 0

    def recv_into(self, view, n=0):
        k = self.sock.recv_into(view, n)
        self.read += k
        return k


@pytest.mark.parametrize("field,value", [
    ("hlen", LIM.max_header_bytes + 1), ("plen", LIM.max_frame_bytes + 1), ("plen", 2**60),
    ("magic", 1), ("version", 9),
])
def test_bad_prefix_rejected_before_reading_header(field, value):
    a, b = socket.socketpair()
    with a, b:
        b.settimeout(2)
        frame = _frame_with(encode_frame(10, 1, {"items": []}), **{field: value})
        a.sendall(bytes(frame[:PREFIX_SIZE]) + b"SENTINEL")  # no header follows
        cs = _CountingSock(b)
        with pytest.raises(ProtocolError):
            read_frame(cs, LIM)  # must not block waiting for a 4 MiB header
        assert cs.read == PREFIX_SIZE
        assert b.recv(8) == b"SENTINEL"  # nothing past the prefix was consumed


def test_read_frame_over_socketpair_round_trip():
    a, b = socket.socketpair()
    with a, b:
        b.settimeout(2)
        metas = [{"items": [[b"k" * 512, 1, 2, 3]] * 100, "ns": b"n"}, {}, [1, 2], b"x" * 70000]
        for i, m in enumerate(metas):
            a.sendall(encode_frame(10 + i, i, m, 0))
        for i, m in enumerate(metas):
            fh, got = read_frame(b, LIM)
            assert (fh.opcode, fh.request_id, got) == (10 + i, i, m)


def test_read_frame_truncated_header_is_connection_error():
    a, b = socket.socketpair()
    with b:
        b.settimeout(2)
        frame = encode_frame(10, 1, {"items": [[b"k", 1, 2, 3]]})
        a.sendall(frame[:-3])
        a.close()
        with pytest.raises(ConnectionError):
            read_frame(b, LIM)


# ---------------------------------------------------------------- scatter/gather IO

def _reader(sock: socket.socket, n: int, out: dict) -> None:
    try:
        buf = bytearray(n)
        recv_exact_into(sock, memoryview(buf))
        out["data"] = buf
    except BaseException as exc:  # surfaced by the test thread
        out["exc"] = exc


class _RecordingSock:
    """Real socket; records what each sendmsg was asked to send vs. what it sent."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock, self.calls = sock, []

    def sendmsg(self, bufs):
        asked = sum(len(b) for b in bufs)
        sent = self.sock.sendmsg(bufs)
        self.calls.append((len(bufs), asked, sent))
        return sent


def _buffers(rng: random.Random, count: int, max_len: int) -> list:
    out = []
    for i in range(count):
        n = rng.choice([0, 1, 7, rng.randrange(max_len)])
        raw = rng.randbytes(n)
        kind = i % 4
        if kind == 0:
            out.append(raw)
        elif kind == 1:
            out.append(bytearray(raw))
        elif kind == 2:
            out.append(memoryview(raw))
        else:  # a non-byte format: sendmsg_all must cast to bytes
            a = array.array("I", raw[: n - n % 4])
            out.append(a)
    return out


def _flat(bufs) -> bytes:
    return b"".join(memoryview(b).cast("B").tobytes() for b in bufs)


@pytest.mark.parametrize("family", [socket.AF_UNIX, socket.AF_INET])
def test_sendmsg_all_many_buffers_kernel_partial_writes(family):
    """> IOV_MAX buffers and ~24 MiB total over a small-buffered socket with a timeout
    (non-blocking under the hood), so the kernel accepts each sendmsg only in part."""
    if family == socket.AF_UNIX:
        a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    else:
        srv = socket.create_server(("127.0.0.1", 0))
        a = socket.create_connection(srv.getsockname())
        b, _ = srv.accept()
        srv.close()
    with a, b:
        a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 << 10)
        b.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)
        a.settimeout(20)
        b.settimeout(20)
        rng = random.Random(1234)
        bufs = _buffers(rng, 1500, 32 << 10)
        bufs.insert(700, rng.randbytes(8 << 20))  # one buffer much larger than the socket
        expect = _flat(bufs)
        out: dict = {}
        t = threading.Thread(target=_reader, args=(b, len(expect), out))
        t.start()
        rec = _RecordingSock(a)
        sendmsg_all(rec, bufs)
        t.join(20)
        assert not t.is_alive()
        assert "exc" not in out, out.get("exc")
        assert out["data"] == expect
        assert sum(s for _, _, s in rec.calls) == len(expect)
        assert any(sent < asked for _, asked, sent in rec.calls), "no partial write happened"
        assert all(n <= 512 for n, _, _ in rec.calls)  # IOV_MAX respected


class _ChoppySock:
    """Fake socket accepting a scripted number of bytes per sendmsg (>= 1)."""

    def __init__(self, caps: list[int]) -> None:
        self.caps, self.out, self.i = caps, bytearray(), 0

    def sendmsg(self, bufs):
        cap = self.caps[self.i % len(self.caps)]
        self.i += 1
        data = b"".join(bytes(b) for b in bufs)[:cap]
        self.out += data
        return len(data)


@FAST
@given(sizes=st.lists(st.integers(0, 300), min_size=0, max_size=1200),
       caps=st.lists(st.integers(1, 5000), min_size=1, max_size=20))
def test_sendmsg_all_injected_partial_writes(sizes, caps):
    bufs = [bytes([i % 251]) * n for i, n in enumerate(sizes)]
    fake = _ChoppySock(caps)
    sendmsg_all(fake, bufs)
    assert fake.out == b"".join(bufs)


class _DribbleSock:
    """Fake socket delivering a scripted number of bytes per recv_into."""

    def __init__(self, data: bytes, caps: list[int]) -> None:
        self.data, self.pos, self.caps, self.i = data, 0, caps, 0

    def recv_into(self, view, n=0):
        n = n or len(view)
        cap = min(n, self.caps[self.i % len(self.caps)], len(self.data) - self.pos)
        self.i += 1
        view[:cap] = self.data[self.pos:self.pos + cap]
        self.pos += cap
        return cap


@FAST
@given(data=st.binary(min_size=1, max_size=5000),
       caps=st.lists(st.integers(1, 700), min_size=1, max_size=10))
def test_recv_exact_into_dribbled(data, caps):
    buf = bytearray(len(data))
    recv_exact_into(_DribbleSock(data, caps), memoryview(buf))
    assert buf == data


@FEW
@given(data=st.binary(min_size=2, max_size=3000), cut=st.integers(0, 2999))
def test_recv_exact_eof_is_connection_error(data, cut):
    cut = min(cut, len(data) - 1)
    with pytest.raises(ConnectionError):
        recv_exact(_DribbleSock(data[:cut], [97]), len(data))


def test_recv_exact_into_socketpair_large_threaded():
    a, b = socket.socketpair()
    with a, b:
        a.settimeout(20)
        b.settimeout(20)
        payload = random.Random(7).randbytes(16 << 20)
        out: dict = {}
        t = threading.Thread(target=_reader, args=(b, len(payload), out))
        t.start()
        # many small writes on one side, one big exact read on the other
        for off in range(0, len(payload), 100_003):
            a.sendall(payload[off:off + 100_003])
        t.join(20)
        assert out.get("data") == payload


@pytest.mark.unit
@pytest.mark.timeout(30)
def test_non_blocking_socket_keeps_the_deadline() -> None:
    """A non-blocking socket (the SDK's TCP connections) is polled for the time left:
    a silent or trickling peer ends the call by its deadline, bytes already there cost
    no wait, and a peer that stops reading cannot hold a sender past it."""
    import time

    from gcache.protocol import recv_exact_into, sendmsg_all

    a, b = socket.socketpair()
    try:
        a.settimeout(0.0)
        buf = bytearray(8)
        t0 = time.monotonic()
        with pytest.raises(socket.timeout):
            recv_exact_into(a, memoryview(buf), time.monotonic() + 0.1)
        assert 0.09 <= time.monotonic() - t0 < 0.5
        b.sendall(b"12345678")
        # bytes are there, but a call made after its deadline starts nothing (as arm)
        with pytest.raises(socket.timeout):
            recv_exact_into(a, memoryview(buf), time.monotonic() - 0.001)
        recv_exact_into(a, memoryview(buf), time.monotonic() + 0.1)
        assert buf == b"12345678"

        def drip() -> None:
            for _ in range(20):
                time.sleep(0.02)
                try:
                    b.send(b"x")
                except OSError:
                    return

        th = threading.Thread(target=drip, daemon=True)
        th.start()
        t0 = time.monotonic()
        with pytest.raises(socket.timeout):
            recv_exact_into(a, memoryview(bytearray(20)), time.monotonic() + 0.1)
        assert time.monotonic() - t0 < 0.5  # not 20 drips x 20 ms
        th.join(2)
        t0 = time.monotonic()
        with pytest.raises(socket.timeout):  # b never reads: the send buffer fills
            sendmsg_all(a, [bytes(64 << 20)], time.monotonic() + 0.1)
        assert time.monotonic() - t0 < 0.5
    finally:
        a.close()
        b.close()
