"""A streamed GET reply on the wire (``"sr": 1``): several frames of the same request id,
``FLAG_MORE`` on all but the last, each standing alone (its rows and payload), together
the whole reply in item order; the memory-resident first items arrive while a slow disk
read (``disk_read_slow`` failpoint) is still running; a plain GET on the same connection
is one frame after it. An SDK get (``Client(stream_gets=True)``) whose deadline passes
mid-stream is a miss, its connection is dropped, and the next get is served whole and
right. The shm transport reads the keys it cannot lease (disk-only ones past the
connection's scratch bound) with a streamed GET."""

from __future__ import annotations

import time

import pytest

from gcache.protocol import FLAG_MORE, Op, encode_frame
from gcache.sdk import Client, Status
from gcache.sdk.transports import onesided, tcp
from gcache.server.disk.log import SLOW_READ_S
from gcache.testing.oracle import check_value, value_for
from gcache.testing.waiting import wait_for

from rawwire import RawConn

pytestmark = [pytest.mark.integration, pytest.mark.faults, pytest.mark.timeout(120)]

SIZE = 300_000
N = 80  # 24 MB through a 16 MiB arena: the first keys live on disk only


def _server(make_cluster, tmp_path, failpoints: str):
    cl = make_cluster(1, "16MiB", slab="1MiB", extra=[
        "--disk-dir", str(tmp_path / "disk"), "--disk", "128MiB", "--segment-bytes", "4MiB",
        "--promote-policy", "never", "--failpoints", failpoints])
    keys = [f"s-{i}".encode() for i in range(N)]
    with Client(cl.addresses, timeout_ms=10_000, transport="tcp") as c:
        for s in range(0, N, 10):
            ks = keys[s:s + 10]
            assert c.put_batch(ks, [value_for(k, SIZE) for k in ks]) == [Status.OK] * 10
            wait_for(lambda: all(st["used_bytes"] <= 0.95 * st["capacity_bytes"]
                                 for st in c.stats().values()), 10)
        wait_for(lambda: c.stats()[cl.addresses[0]]["disk_objects"] >= 30, 10)
    return cl, keys


def _read_reply(conn: RawConn, rid: int) -> list[tuple[float, int, list, bytes]]:
    """Every frame of one GET reply: (arrival, flags, rows, payload)."""
    frames = []
    while True:
        fh, meta = conn.read()
        assert (fh.opcode, fh.request_id, fh.status) == (Op.GET, rid, 0), meta
        assert fh.is_response
        payload = b""
        while len(payload) < fh.payload_len:
            payload += conn.sock.recv(fh.payload_len - len(payload))
        frames.append((time.monotonic(), fh.flags, meta["items"], payload))
        if not fh.flags & FLAG_MORE:
            return frames


def test_streamed_reply_frames_in_order_first_items_before_slow_read(make_cluster, tmp_path):
    cl, keys = _server(make_cluster, tmp_path, "disk_read_slow=1x")
    frame = keys[-2:] + keys[:10]  # two memory hits, then ten disk-only items
    with RawConn(cl.addresses[0]) as conn:
        conn.auth()
        items = [[k, 0, 1 << 30, 0] for k in frame]
        t0 = time.monotonic()
        conn.send(encode_frame(Op.GET, 7, {"ns": b"default", "items": items, "sr": 1}))
        frames = _read_reply(conn, 7)
        assert len(frames) >= 2
        assert all(f[1] & FLAG_MORE for f in frames[:-1])
        # the memory hits went out before the slow disk read ended
        assert len(frames[0][2]) >= 2
        assert frames[-1][0] - frames[0][0] >= SLOW_READ_S * 0.8
        assert frames[-1][0] - t0 < SLOW_READ_S * 4  # one slow read, not one per item
        rows = [r for f in frames for r in f[2]]
        assert [r[0] for r in rows] == [int(Status.OK)] * len(frame)
        for f in frames:  # each frame's rows describe its own payload
            assert sum(r[3] for r in f[2]) == len(f[3])
        data = b"".join(f[3] for f in frames)
        assert data == b"".join(value_for(k, SIZE) for k in frame)
        # the connection is in step: a plain GET after it is answered in one frame
        conn.send(encode_frame(Op.GET, 8, {"ns": b"default", "items": items[:3]}))
        again = _read_reply(conn, 8)
        assert len(again) == 1 and len(again[0][2]) == 3
        assert again[0][3] == b"".join(value_for(k, SIZE) for k in frame[:3])


def test_bad_stream_flag_is_refused(make_cluster, tmp_path):
    cl = make_cluster(1, "16MiB", slab="1MiB")
    with RawConn(cl.addresses[0]) as conn:
        conn.auth()
        conn.send(encode_frame(Op.GET, 3, {"ns": b"default", "items": [[b"k", 0, 10, 0]],
                                           "sr": 2}))
        conn.expect_error(Status.BAD_REQUEST, rid=3)


def test_deadline_mid_stream_is_a_miss_and_the_next_get_is_whole(make_cluster, tmp_path):
    cl, keys = _server(make_cluster, tmp_path, "disk_read_slow=1x")
    frame = keys[-2:] + keys[:10]
    with Client(cl.addresses, timeout_ms=int(SLOW_READ_S * 1000 * 0.4),
                transport="tcp", conns_per_server=1, stream_gets=True) as c:
        bufs = [bytearray(SIZE) for _ in frame]
        t0 = time.monotonic()
        st = c.get_batch_into(frame, bufs)
        assert time.monotonic() - t0 < SLOW_READ_S  # the deadline, not the slow read
        assert Status.TIMEOUT in st and all(s in (Status.OK, Status.TIMEOUT) for s in st)
        # a timed-out item never counts as a hit; the rest that did land are right
        for k, b, s in zip(frame, bufs, st):
            if s == Status.OK:
                assert check_value(k, bytes(b))
        time.sleep(SLOW_READ_S)  # the slow read ends; the old stream is gone with its socket
        bufs = [bytearray(SIZE) for _ in frame]
        st = c.get_batch_into(frame, bufs, timeout_ms=10_000)
        assert st == [Status.OK] * len(frame)
        assert all(check_value(k, bytes(b)) for k, b in zip(frame, bufs))


def test_shm_keys_the_server_cannot_lease_are_read_with_a_streamed_get(make_cluster, tmp_path,
                                                                       monkeypatch):
    """Disk-only keys are leased from arena scratch chunks while the connection's bound
    (a quarter of this 16 MiB arena) and the arena's free room allow; the rest answer a
    LEASE with BUSY, and the shm transport reads them with a plain GET that asks for a
    streamed reply (its first items travel while the later ones are read), though the
    client's ``stream_gets`` is off. Memory hits stay leased."""
    cl, keys = _server(make_cluster, tmp_path, "")
    sent: list[tuple[int, dict]] = []
    real = tcp.encode_frame

    def spy(op, rid, meta, *a, **kw):
        sent.append((op, meta))
        return real(op, rid, meta, *a, **kw)

    monkeypatch.setattr(tcp, "encode_frame", spy)
    disk_only = keys[:20]  # 6 MB: past the 4 MiB a connection may hold
    frame = keys[-2:] + disk_only  # two memory hits, then twenty disk-only items
    before = dict(onesided.STATS)
    hits_before = _disk_hits(cl)
    with Client(cl.addresses, timeout_ms=10_000, transport="shm", conns_per_server=1) as c:
        bufs = [bytearray(SIZE) for _ in frame]
        assert c.get_batch_into(frame, bufs) == [Status.OK] * len(frame)
        assert all(check_value(k, bytes(b)) for k, b in zip(frame, bufs))
    gets = [m for op, m in sent if op == Op.GET]
    fell_back = onesided.STATS["tcp_fallback_items"] - before["tcp_fallback_items"]
    leased = onesided.STATS["shm_get_items"] - before["shm_get_items"]
    assert fell_back >= 20 - (4 << 20) // SIZE and leased + fell_back == len(frame)
    assert gets and all(m.get("sr") == 1 for m in gets)
    got = [it[0] for m in gets for it in m["items"]]
    assert len(got) == fell_back and set(got) <= set(disk_only)
    # each disk-only key is one disk hit, leased or read by the GET after a BUSY
    assert _disk_hits(cl) - hits_before == len(disk_only)


def _disk_hits(cl) -> int:
    with Client(cl.addresses, timeout_ms=10_000, transport="tcp") as c:
        return next(iter(c.stats().values()))["disk_hits"]
