"""A client may pipeline: several request frames in one write, and a PUT whose payload
arrives in the same segment as its header. The server reads ahead (prefix and header in
one ``recv``), so the bytes past one frame must feed that frame's payload, then the next
frame: every request is answered, in order, and the stored bytes are the sent ones.
In-process server, hand-made frames over one raw socket."""

from __future__ import annotations

import os
import uuid

import pytest
import xxhash

from gcache.config import load_config
from gcache.protocol import Op, encode_frame
from gcache.server.app import Server

from rawwire import RawConn

pytestmark = [pytest.mark.integration, pytest.mark.timeout(30)]

NS = b"pipe"


@pytest.fixture(scope="module")
def server():
    name = f"pipe-{uuid.uuid4().hex[:8]}"
    srv = Server(load_config("server", env={}, cli={
        "listen": "127.0.0.1:0", "name": name, "memory_bytes": "32MiB",
        "slab_bytes": "1MiB", "nixl": "off", "log_format": "text"}))
    srv.start()
    yield srv
    srv.stop()
    try:
        os.unlink(f"/dev/shm/gcache-{name}.arena")
    except FileNotFoundError:
        pass


def _put_frame(rid: int, key: bytes, value: bytes) -> bytes:
    n = len(value)
    item = [key, n, 0, n, 0, xxhash.xxh3_64_intdigest(value)]
    return encode_frame(Op.PUT, rid, {"ns": NS, "items": [item]}, n) + value


def test_two_frames_in_one_write_get_both_replies(server):
    with RawConn(server.address) as c:
        c.auth()
        c.send(encode_frame(Op.EXISTS, 11, {"ns": NS, "items": [b"absent-a"]}),
               encode_frame(Op.EXISTS, 12, {"ns": NS, "items": [b"absent-b", b"absent-c"]}))
        fh1, m1 = c.read()
        fh2, m2 = c.read()
        assert (fh1.request_id, fh1.status) == (11, 0)
        assert len(m1["st"]) == 1 and len(m2["st"]) == 2
        assert fh2.request_id == 12 and fh2.status == 0


def test_put_payload_in_header_segment_then_pipelined_get(server):
    value = os.urandom(5000)
    key = b"seg-" + uuid.uuid4().hex.encode()
    with RawConn(server.address) as c:
        c.auth()
        # one write: PUT prefix + header + payload, then a GET of the same key
        c.send(_put_frame(21, key, value),
               encode_frame(Op.GET, 22, {"ns": NS, "items": [[key, 0, len(value), 0]]}))
        fh, meta = c.read()
        assert (fh.opcode, fh.request_id, fh.status, meta["st"]) == (Op.PUT, 21, 0, [0])
        fh, meta = c.read()
        assert (fh.opcode, fh.request_id, fh.status) == (Op.GET, 22, 0)
        status, total, _version, length, csum = meta["items"][0]
        assert (status, total, length) == (0, len(value), len(value))
        got = bytearray(length)
        view, n = memoryview(got), 0
        while n < length:
            k = c.sock.recv_into(view[n:])
            assert k
            n += k
        assert bytes(got) == value and csum == xxhash.xxh3_64_intdigest(value)


def test_many_small_puts_in_one_write_all_stored(server):
    values = {b"many-%d-" % i + uuid.uuid4().hex.encode(): os.urandom(100 + 37 * i)
              for i in range(40)}
    with RawConn(server.address) as c:
        c.auth()
        c.send(*[_put_frame(100 + i, k, v) for i, (k, v) in enumerate(values.items())])
        for i in range(len(values)):
            fh, meta = c.read()
            assert (fh.request_id, fh.status, meta["st"]) == (100 + i, 0, [0])
        c.send(encode_frame(Op.EXISTS, 999, {"ns": NS, "items": list(values)}))
        fh, meta = c.read()
        assert fh.request_id == 999 and meta["st"] == [0] * len(values)
