"""A co-located reader leases disk-resident keys: the server reads each whole record into
an arena scratch chunk charged to the connection, verifies it and answers a LEASE row
(``shm_ops._lease_disk``), so the bytes cross no socket and need no second round trip.

The chunk is the connection's until RELEASE, lease expiry or close, and is freed then;
a read that fails verification is never leased and its chunk is freed at once; values
are right, and nothing falls back to a GET while the connection has room.
"""

from __future__ import annotations

import mmap
import socket
import struct
import time

import pytest

from gcache.protocol import FLAG_MORE, LEASE_ROW, Op, encode_frame, unpack_lease_rows
from gcache.sdk import Client, Status
from gcache.sdk.transports import onesided
from gcache.server.disk.log import SLOW_READ_S
from gcache.testing.oracle import check_value, value_for
from gcache.testing.waiting import wait_for

from rawwire import RawConn

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]

SIZE = 200_000
N = 200  # 40 MB through a 32 MiB arena: the first keys live on disk only


def _server(make_cluster, tmp_path, failpoints: str = ""):
    cl = make_cluster(1, "32MiB", slab="1MiB", extra=[
        "--disk-dir", str(tmp_path / "disk"), "--disk", "128MiB", "--segment-bytes", "4MiB",
        "--promote-policy", "never", "--failpoints", failpoints])
    keys = [b"d-%d" % i for i in range(N)]
    with Client(cl.addresses, timeout_ms=10_000, transport="tcp", namespace="t") as c:
        for s in range(0, N, 10):
            ks = keys[s:s + 10]
            assert c.put_batch(ks, [value_for(k, SIZE) for k in ks]) == [Status.OK] * 10
            wait_for(lambda: _below_high_watermark(c), 10)
        wait_for(lambda: _stats(c)["disk_objects"] >= 40, 10)
        # room for the reads: the arena is kept 90-95 % full, and scratch never evicts
        assert c.delete_batch(keys[-20:]) == [Status.OK] * 20
    return cl, keys[:12]  # among the first demoted: on disk only


def _in_memory(cl) -> list[bytes]:
    """Keys the memory tier holds (the last ones put and not deleted)."""
    with Client(cl.addresses, timeout_ms=10_000, transport="tcp", namespace="t") as c:
        cand = [b"d-%d" % i for i in range(N - 40, N - 20)]
        return [k for k, ok in zip(cand, c.exists_batch(cand)) if ok][-4:]


def _stats(c: Client) -> dict:
    return next(iter(c.stats().values()))


def _below_high_watermark(c: Client) -> bool:
    st = _stats(c)
    return st["used_bytes"] <= 0.95 * st["capacity_bytes"]


def _server_stats(cl) -> dict:
    with Client(cl.addresses, transport="tcp", timeout_ms=5000) as c:
        return _stats(c)


def _scratch_freed(cl) -> bool:
    st = _server_stats(cl)
    return st["scratch_bytes"] == 0 and st["reserved_bytes"] == 0


def test_disk_only_keys_are_leased_from_scratch_chunks_freed_on_release(make_cluster,
                                                                       tmp_path):
    cl, keys = _server(make_cluster, tmp_path)
    before, reserved = dict(onesided.STATS), _server_stats(cl)["scratch_reserved"]
    with Client(cl.addresses, timeout_ms=10_000, transport="shm", conns_per_server=1,
                namespace="t") as c:
        for _ in range(2):  # the second time through the same (freed, reused) room
            bufs = [bytearray(SIZE) for _ in keys]
            assert c.get_batch_into(keys, bufs) == [Status.OK] * len(keys)
            assert all(check_value(k, bytes(b)) for k, b in zip(keys, bufs))
            assert c.get_batch(keys[:3]) == [value_for(k, SIZE) for k in keys[:3]]
    assert onesided.STATS["tcp_fallback_items"] == before["tcp_fallback_items"]
    assert onesided.STATS["shm_get_items"] - before["shm_get_items"] == 2 * (len(keys) + 3)
    st = _server_stats(cl)
    assert st["scratch_reserved"] - reserved == 2 * (len(keys) + 3)
    assert st["disk_objects"] >= len(keys)  # read where they are: promotion is off
    wait_for(lambda: _scratch_freed(cl), 10)


def _lease(c: RawConn, rid: int, keys: list[bytes]) -> list:
    c.send(encode_frame(Op.LEASE, rid, {"ns": b"t", "items": [[k, 0] for k in keys]}))
    fh, rep = c.read()
    assert fh.status == 0 and fh.request_id == rid, rep
    return rep["items"]


def test_an_expired_disk_lease_frees_its_chunk(make_cluster, tmp_path, monkeypatch):
    monkeypatch.setenv("GCACHE_SHM_LEASE_MS", "400")
    cl, keys = _server(make_cluster, tmp_path)
    with RawConn(cl.addresses[0]) as c:
        c.auth()
        rows = _lease(c, 2, keys[:4])
        assert [r[0] for r in rows] == [Status.OK] * 4
        assert len({r[3] for r in rows}) == 4  # each its own place in the arena
        assert _server_stats(cl)["scratch_bytes"] >= 4 * SIZE
        wait_for(lambda: _scratch_freed(cl), 10)  # reaped, never released
        c.send(encode_frame(Op.RELEASE, 3, {"leases": [r[4] for r in rows]}))
        fh, rep = c.read()
        assert rep["st"] == [Status.TIMEOUT] * 4  # what a late reader copied may be torn


def test_closing_the_connection_frees_its_disk_leases(make_cluster, tmp_path):
    cl, keys = _server(make_cluster, tmp_path)
    c = RawConn(cl.addresses[0])
    c.auth()
    assert [r[0] for r in _lease(c, 2, keys[:4])] == [Status.OK] * 4
    assert _server_stats(cl)["scratch_bytes"] >= 4 * SIZE
    c.close()
    wait_for(lambda: _scratch_freed(cl), 10)


def test_a_corrupt_read_is_never_leased_and_its_chunk_is_freed(make_cluster, tmp_path):
    cl, keys = _server(make_cluster, tmp_path, "disk_read_corrupt=1.0")
    with RawConn(cl.addresses[0]) as c:
        c.auth()
        rows = _lease(c, 2, keys[:4])
        assert [r[0] for r in rows] == [Status.CORRUPT] * 4 and {r[4] for r in rows} == {0}
    st = _server_stats(cl)
    assert st["disk_corrupt_dropped"] == 4 and st["scratch_bytes"] == 0
    with Client(cl.addresses, timeout_ms=10_000, transport="shm", namespace="t") as c:
        assert c.get_batch(keys[:4]) == [None] * 4  # dropped: never served


def test_a_reader_that_never_releases_holds_at_most_its_bound(make_cluster, tmp_path):
    """Scratch chunks are charged to the connection (at most a quarter of the arena) and
    never evict: a reader asking for more than the arena has free gets BUSY, unread, for
    the rest, and holds no more than its bound; a second connection gets only what is
    left, and everything comes back once both are gone."""
    cl, keys = _server(make_cluster, tmp_path)
    bound = (32 << 20) // 4
    with RawConn(cl.addresses[0]) as a, RawConn(cl.addresses[0]) as b:
        a.auth()
        b.auth()
        rows = _lease(a, 2, keys[:12] * 4)  # 9.6 MB asked, past the bound; none released
        st = [r[0] for r in rows]
        assert Status.BUSY in st and set(st) <= {Status.OK, Status.BUSY}
        held = _server_stats(cl)["scratch_bytes"]
        assert 0 < held <= bound
        assert held >= st.count(Status.OK) * SIZE
        rows = _lease(b, 2, keys[:4])
        assert {r[0] for r in rows} <= {Status.OK, Status.BUSY}
        assert _server_stats(cl)["scratch_bytes"] <= 2 * bound
    wait_for(lambda: _scratch_freed(cl), 10)


def test_a_key_in_no_tier_is_a_miss_and_takes_no_chunk(make_cluster, tmp_path):
    """A memory miss is looked up by the disk read itself: a key no tier holds answers
    MISS (not BUSY: no GET follows), and no scratch chunk is reserved for it."""
    cl, keys = _server(make_cluster, tmp_path)
    reserved = _server_stats(cl)["scratch_reserved"]
    with RawConn(cl.addresses[0]) as c:
        c.auth()
        rows = _lease(c, 2, [b"absent-1", keys[0], b"absent-2"])
        assert [r[0] for r in rows] == [Status.MISS, Status.OK, Status.MISS]
        assert _server_stats(cl)["scratch_reserved"] - reserved == 1
    before = dict(onesided.STATS)
    with Client(cl.addresses, timeout_ms=10_000, transport="shm", namespace="t") as c:
        assert c.get_batch([b"absent-1", keys[1]]) == [None, value_for(keys[1], SIZE)]
    assert onesided.STATS["tcp_fallback_items"] == before["tcp_fallback_items"]

def _streamed_lease(c: RawConn, rid: int, keys: list[bytes]
                    ) -> list[tuple[list[int], list, float]]:
    """A LEASE asking for a streamed reply: each frame's ``(ix, rows, arrival)``."""
    c.send(encode_frame(Op.LEASE, rid, {"ns": b"t", "items": [[k, 0] for k in keys],
                                        "pk": 1, "sr": 1}))
    frames = []
    while True:
        fh, rep = c.read()
        assert fh.status == 0 and fh.request_id == rid and fh.opcode == Op.LEASE, rep
        if "ix" not in rep:  # one frame, every row in request order
            assert not fh.flags & FLAG_MORE and not frames
            flat = unpack_lease_rows(rep["packed"], len(keys))
            return [(list(range(len(keys))), [list(flat[j:j + LEASE_ROW])
                                              for j in range(0, len(flat), LEASE_ROW)],
                     time.monotonic())]
        flat = unpack_lease_rows(rep["packed"], len(rep["ix"]))
        frames.append((rep["ix"], [list(flat[j:j + LEASE_ROW])
                                   for j in range(0, len(flat), LEASE_ROW)], time.monotonic()))
        if not fh.flags & FLAG_MORE:
            return frames


def test_a_streamed_lease_sends_ready_rows_first_then_disk_rows_as_they_land(
        make_cluster, tmp_path):
    """``"sr": 1``: the rows ready at once (memory hits) come in the first frame, while a
    slow disk read (``disk_read_slow``) is still running, then the memory misses' rows
    in request order as their disk reads land (a key in no tier among them: MISS); every
    row exactly once, every leased span holds its value, RELEASE frees them all."""
    cl, disk_keys = _server(make_cluster, tmp_path, "disk_read_slow=1x")
    mem_keys = _in_memory(cl)
    assert mem_keys
    keys = disk_keys[:6] + mem_keys + [b"absent"] + disk_keys[6:]
    disk_ix = [i for i, k in enumerate(keys) if k not in mem_keys]  # read from disk
    with RawConn(cl.addresses[0]) as c:
        c.auth()
        frames = _streamed_lease(c, 2, keys)
        assert len(frames) >= 2, [ix for ix, _ in frames]
        assert frames[-1][2] - frames[0][2] >= SLOW_READ_S * 0.8  # sent before the read ended
        assert sorted(frames[0][0]) == frames[0][0] == sorted(set(range(len(keys))) -
                                                              set(disk_ix))
        assert [i for ix, _, _ in frames[1:] for i in ix] == disk_ix
        rows = {i: r for ix, rs, _ in frames for i, r in zip(ix, rs)}
        assert sorted(rows) == list(range(len(keys)))
        assert rows[keys.index(b"absent")][0] == Status.MISS
        shm = c.auth_reply["shm"]
        with open(shm["path"], "rb") as f, mmap.mmap(f.fileno(), 0,
                                                     prot=mmap.PROT_READ) as arena:
            for i, k in enumerate(keys):
                if k == b"absent":
                    continue
                st, total, _, off, _, _ = rows[i]
                assert st == Status.OK and total == SIZE, (k, rows[i])
                assert check_value(k, arena[off:off + total]), k
        # every streamed disk lease still holds its chunk until RELEASE
        assert _server_stats(cl)["scratch_bytes"] >= len(disk_keys) * SIZE
        lids = [r[4] for r in rows.values() if r[0] == Status.OK]
        c.send(encode_frame(Op.RELEASE, 3, {"leases": lids}))
        fh, rep = c.read()
        assert rep["st"] == [Status.OK] * len(lids)
        wait_for(lambda: _scratch_freed(cl), 10)
        # with nothing to read from disk the reply is one frame, as without "sr"
        frames = _streamed_lease(c, 4, mem_keys)
        assert len(frames) == 1 and [r[0] for r in frames[0][1]] == [Status.OK] * len(mem_keys)


def test_a_reader_gone_mid_stream_leaks_no_chunk(make_cluster, tmp_path):
    """A reader that resets its connection after a streamed reply's first frame, while a
    slow disk read goes on: the server's next send fails; the memory leases sent, and the
    disk reads' chunks, leased or not, are all freed; the keys still read right."""
    cl, disk_keys = _server(make_cluster, tmp_path, "disk_read_slow=2x")
    mem_keys = _in_memory(cl)
    for rid in (2, 3):
        c = RawConn(cl.addresses[0])
        c.auth()
        c.send(encode_frame(Op.LEASE, rid, {"ns": b"t", "items": [[k, 0] for k in
                                                                 mem_keys + disk_keys],
                                            "pk": 1, "sr": 1}))
        fh, rep = c.read()
        assert fh.flags & FLAG_MORE and len(rep["ix"]) == len(mem_keys)  # ready rows first
        c.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        c.close()  # an RST: the server's next frame cannot be sent
        wait_for(lambda: _scratch_freed(cl), 10)
    with Client(cl.addresses, timeout_ms=10_000, transport="shm", namespace="t") as c:
        bufs = [bytearray(SIZE) for _ in disk_keys]
        assert c.get_batch_into(disk_keys, bufs) == [Status.OK] * len(disk_keys)
        assert all(check_value(k, bytes(b)) for k, b in zip(disk_keys, bufs))
