"""``FrameReader`` (one ``recv`` for prefix and header) never loses or reorders a byte:
bytes read ahead past a frame's header feed that frame's payload views, then the next
frame; a header longer than the buffer is assembled whole; with read-ahead off it takes
exactly what was asked, leaving the rest in the socket. Over a real socketpair."""

from __future__ import annotations

import os
import socket
import threading
import time

import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from gcache.errors import ProtocolError
from gcache.frame_reader import FrameReader
from gcache.protocol import PREFIX_SIZE, Limits, Op, decode_meta, encode_frame

pytestmark = [pytest.mark.unit, pytest.mark.timeout(10)]

LIM = Limits()


@pytest.fixture
def pair():
    a, b = socket.socketpair()
    a.settimeout(5)
    b.settimeout(5)
    yield a, b
    a.close()
    b.close()


def _read(r: FrameReader):
    fh, prefix = r.read_prefix()
    return fh, decode_meta(r.read_header(fh, prefix), LIM)


def test_two_frames_in_one_write_are_both_read(pair):
    a, b = pair
    a.sendall(encode_frame(Op.EXISTS, 7, {"items": [b"k1"]})
              + encode_frame(Op.GET, 8, {"items": [[b"k2", 0, 10, 0]]}))
    r = FrameReader(b, LIM)
    fh1, m1 = _read(r)
    assert (fh1.opcode, fh1.request_id, m1) == (Op.EXISTS, 7, {"items": [b"k1"]})
    assert r.buffered > 0  # the second frame came in the same recv
    fh2, m2 = _read(r)
    assert (fh2.opcode, fh2.request_id, m2) == (Op.GET, 8, {"items": [[b"k2", 0, 10, 0]]})
    assert r.buffered == 0


def test_payload_in_the_header_segment_then_next_frame(pair):
    a, b = pair
    payload = os.urandom(3000) + os.urandom(5000)
    a.sendall(encode_frame(Op.PUT, 1, {"n": 2}, len(payload)) + payload
              + encode_frame(Op.PING, 2, {}))
    r = FrameReader(b, LIM)
    fh, meta = _read(r)
    assert fh.payload_len == len(payload)
    v1, v2 = memoryview(bytearray(3000)), memoryview(bytearray(5000))
    r.recv_into_many([v1, v2])
    assert bytes(v1) + bytes(v2) == payload
    fh2, _ = _read(r)
    assert (fh2.opcode, fh2.request_id) == (Op.PING, 2)


def test_payload_larger_than_buffer_split_across_reads(pair):
    a, b = pair
    payload = os.urandom(200_000)
    frame = encode_frame(Op.PUT, 1, {"n": 1}, len(payload)) + payload
    r = FrameReader(b, LIM, capacity=4096)
    a.sendall(frame[:1000])  # prefix, header and a few payload bytes first
    fh, _ = _read(r)
    views = [memoryview(bytearray(50_000)) for _ in range(4)]
    t = threading.Thread(target=a.sendall, args=(frame[1000:],))
    t.start()
    r.recv_into_many(views)
    t.join()
    assert b"".join(bytes(v) for v in views) == payload


def test_header_longer_than_buffer_is_read_whole(pair):
    a, b = pair
    keys = [os.urandom(40) for _ in range(500)]  # ~21 KiB header
    a.sendall(encode_frame(Op.EXISTS, 3, {"items": keys}) + encode_frame(Op.PING, 4, {}))
    r = FrameReader(b, LIM, capacity=1024)
    fh, meta = _read(r)
    assert fh.header_len > 1024 and meta == {"items": keys}
    assert _read(r)[0].request_id == 4


def test_frames_straddling_the_buffer_end_slide_and_stay_in_order(pair):
    a, b = pair
    frames = [encode_frame(Op.EXISTS, i, {"items": [os.urandom(i % 50 + 1)]})
              for i in range(200)]
    a.sendall(b"".join(frames))
    r = FrameReader(b, LIM, capacity=PREFIX_SIZE + 100)
    assert [_read(r)[0].request_id for _ in range(200)] == list(range(200))


def test_no_read_ahead_takes_only_the_prefix(pair):
    a, b = pair
    frame = encode_frame(Op.AUTH, 1, {"mac": b"x" * 32})
    a.sendall(frame)
    r = FrameReader(b, LIM, read_ahead=False)
    fh, prefix = r.read_prefix()
    assert r.buffered == 0
    rest = b.recv(len(frame), socket.MSG_PEEK)  # the header is still in the socket
    assert rest == frame[PREFIX_SIZE:]
    assert decode_meta(r.read_header(fh, prefix), LIM) == {"mac": b"x" * 32}


def test_corrupt_header_crc_is_refused(pair):
    a, b = pair
    frame = bytearray(encode_frame(Op.EXISTS, 1, {"items": [b"k"]}))
    frame[-1] ^= 0xFF
    a.sendall(bytes(frame))
    r = FrameReader(b, LIM)
    fh, prefix = r.read_prefix()
    with pytest.raises(ProtocolError, match="CRC"):
        r.read_header(fh, prefix)


def test_eof_mid_prefix_is_a_connection_error(pair):
    a, b = pair
    a.sendall(encode_frame(Op.PING, 1, {})[:10])
    a.shutdown(socket.SHUT_WR)
    with pytest.raises(ConnectionError):
        FrameReader(b, LIM).read_prefix()


@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(st.integers(0, 30_000), min_size=1, max_size=8),
       flags=st.lists(st.booleans(), min_size=8, max_size=8),
       early=st.integers(0, 40_000), capacity=st.sampled_from([1024, 4096, 16 << 10]),
       deadline=st.booleans())
def test_payload_digests_cover_buffered_and_received_bytes(sizes, flags, early, capacity,
                                                           deadline):
    """A PUT payload hashed as it lands: views filled from the reader's buffer (whole or
    in part) and views received from the socket each get xxh3_64 of exactly their
    bytes, the unflagged ones None, and the next frame still reads."""
    a, b = socket.socketpair()
    b.settimeout(5)
    try:
        payload = os.urandom(sum(sizes))
        start = encode_frame(Op.PUT, 1, {"n": len(sizes)}, len(payload))
        frame = start + payload + encode_frame(Op.PING, 2, {})
        head = len(start) + early  # some payload bytes (or the next frame) come with it
        a.sendall(frame[:head])
        r = FrameReader(b, LIM, capacity=capacity)
        _read(r)
        want = flags[:len(sizes)]
        views = [memoryview(bytearray(n)) for n in sizes]
        t = threading.Thread(target=a.sendall, args=(frame[head:],))
        t.start()
        got = r.recv_into_many(views, time.monotonic() + 10 if deadline else None, want)
        t.join(10)
        pos = 0
        for v, w, d, n in zip(views, want, got, sizes):
            assert bytes(v) == payload[pos:pos + n]
            assert d == (xxhash.xxh3_64_intdigest(payload[pos:pos + n]) if w else None)
            pos += n
        assert _read(r)[0].opcode == Op.PING
    finally:
        a.close()
        b.close()
