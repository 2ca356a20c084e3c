"""The co-located shared-memory transport against real servers: round trips, automatic
choice, leases vs eviction, connection-owned leases and slots, forged ids, dead servers.

ALLOC/COMMIT are served only to writers the server trusts with its arena (NIXL peers,
or same-host peers under ``--shm-trusted-writers``); their tests use such a server and
write the chunk through a read-write mapping of their own, as such a writer would."""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest

from gcache.hashing import checksum
from gcache.protocol import Limits, Op
from gcache.sdk import Client, Status
from gcache.sdk.transports import onesided, shm
from gcache.sdk.transports.base import GetItem, KeyItem, TransportTimeout, Work
from gcache.sdk.transports.factory import make_transport
from gcache.sdk.transports.shm import ShmTransport
from gcache.sdk.transports.tcp import TcpTransport

pytestmark = pytest.mark.integration

SIZES = [1, 7, 4096, 65536, 65537, 1 << 20, (3 << 20) + 5, 4 << 20]


@pytest.fixture
def srv(make_cluster):
    return make_cluster(1, "96MiB", slab="8MiB")


@pytest.fixture
def trusted(make_cluster):
    return make_cluster(1, "96MiB", slab="8MiB", extra=["--shm-trusted-writers", "true"])


def _write_arena(t: ShmTransport, off: int, data: bytes) -> None:
    """What a trusted writer does after ALLOC (the SDK's own mapping is read-only)."""
    fd = os.open(t.auth_reply["shm"]["path"], os.O_RDWR)
    try:
        os.pwrite(fd, data, off)
    finally:
        os.close(fd)


def _raw(addr: str, mode: str = "shm") -> ShmTransport:
    t = ShmTransport(addr, "", Limits(), 2.0, mode)
    t.connect(time.monotonic() + 5)
    return t


def _value(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def test_shm_round_trip_every_form(srv):
    before = dict(onesided.STATS)
    with Client(srv.addresses, namespace="shm", transport="shm", timeout_ms=10_000) as c:
        vals = [_value(n, i) for i, n in enumerate(SIZES)]
        keys = [f"k{n}" for n in SIZES]
        for k, v in zip(keys, vals):  # single put/get, bytes
            assert c.put(k, v.tobytes()) == Status.OK
            assert c.get(k) == v.tobytes()
        assert c.get("absent") is None
        # batch forms straight from / into numpy buffers
        vals2 = [_value(n, 100 + i) for i, n in enumerate(SIZES)]
        assert all(s == Status.OK for s in c.put_batch_from(keys, vals2))
        bufs = [np.zeros(n, dtype=np.uint8) for n in SIZES]
        st = c.get_batch_into(keys, bufs)
        assert all(s == Status.OK for s in st), st
        for b, v in zip(bufs, vals2):
            assert np.array_equal(b, v)
        got = c.get_batch(keys + ["absent"])
        assert [bytes(g) for g in got[:-1]] == [v.tobytes() for v in vals2] and got[-1] is None
        # the plain ops still run over the control connection
        assert c.exists("k1") is True
        assert c.delete("k1") == Status.OK
        assert c.get("k1") is None
    after = onesided.STATS
    assert after["shm_get_items"] > before["shm_get_items"]
    assert after["shm_put_items"] > before["shm_put_items"]
    assert after["tcp_fallback_items"] == before["tcp_fallback_items"]


def test_auto_picks_shm_and_tcp_when_forced(srv, monkeypatch):
    addr = srv.addresses[0]
    assert isinstance(make_transport("tcp", addr, "", Limits(), 1.0), TcpTransport)
    t = make_transport("auto", addr, "", Limits(), 1.0)
    t.connect(time.monotonic() + 5)
    assert t.kind == "shm"
    t.close()
    before = onesided.STATS["shm_get_items"]
    with Client(srv.addresses, transport="tcp") as c:
        assert c.put("x", b"abc") == Status.OK and c.get("x") == b"abc"
    assert onesided.STATS["shm_get_items"] == before
    with Client(srv.addresses) as c:  # auto is the default
        assert c.get("x") == b"abc"
    assert onesided.STATS["shm_get_items"] == before + 1
    # not co-located (the arena cannot be mapped): auto falls back, shm refuses
    monkeypatch.setattr(shm, "_acquire", lambda info: None)
    t = make_transport("auto", addr, "", Limits(), 1.0)
    t.connect(time.monotonic() + 5)
    assert t.kind == "tcp"
    w = Work(Op.GET, b"default", [GetItem(b"x", 0, 100, 0, None)], time.monotonic() + 5, None)
    assert bytes(t.execute(w)[0].data) == b"abc"
    t.close()
    with pytest.raises(ConnectionError):
        _raw(addr, "shm")


def _fill(addr: str, total: int) -> None:
    with Client([addr], transport="tcp", timeout_ms=10_000) as c:
        blob = np.ones(1 << 20, dtype=np.uint8)
        for i in range(total // (1 << 20)):
            c.put(f"fill{i}", blob)


def test_lease_blocks_eviction_and_close_releases(srv):
    addr = srv.addresses[0]
    with Client([addr], transport="tcp") as c:
        v = _value(1 << 20, 7).tobytes()
        assert c.put("held", v) == Status.OK
        assert c.put("free", v) == Status.OK
    t = _raw(addr)
    rep = t.call(Op.LEASE, {"ns": b"default", "items": [[b"held", 0]]}, time.monotonic() + 5)
    st, total, _ver, off, lid, _csum = rep["items"][0]
    assert st == Status.OK and total == len(v) and lid
    t2 = _raw(addr)
    rep2 = t2.call(Op.LEASE, {"ns": b"default", "items": [[b"free", 0]]}, time.monotonic() + 5)
    assert rep2["items"][0][0] == Status.OK
    with Client([addr], transport="tcp") as c:  # held leases show in the server's stats
        assert c.stats()[addr]["shm_leases"] == 2
    t2.close()  # the server releases t2's lease when its connection closes
    time.sleep(0.2)
    _fill(addr, 300 << 20)  # ~3x the arena: everything unpinned is evicted
    assert bytes(t.shm.map.mm[off:off + total]) == v  # the leased bytes were never reused
    with Client([addr], transport="tcp") as c:
        assert c.exists("free") is False
        assert c.get("held") == v
    rel = t.call(Op.RELEASE, {"leases": [lid]}, time.monotonic() + 5)
    assert rel["st"] == [Status.OK]
    t.close()


def test_forged_ids_are_rejected(trusted):
    addr = trusted.addresses[0]
    with Client([addr]) as c:
        assert c.put("a", b"x" * 5000) == Status.OK
    a, b = _raw(addr), _raw(addr)
    dl = time.monotonic() + 5
    lid = a.call(Op.LEASE, {"ns": b"default", "items": [[b"a", 0]]}, dl)["items"][0][4]
    _st, soff, sid = a.call(Op.ALLOC, {"ns": b"default", "items": [
        [b"n", 10, 0, 10, 0, checksum(b"0123456789")]]}, dl)["items"][0]
    _write_arena(a, soff, b"0123456789")
    # another connection cannot release or commit them; unknown ids are refused
    assert b.call(Op.RELEASE, {"leases": [lid, 999_999, -3]}, dl)["st"] == [
        Status.BAD_REQUEST] * 3
    assert b.call(Op.COMMIT, {"slots": [sid, 424242], "abort": [sid]}, dl)["st"] == [
        Status.BAD_REQUEST] * 2
    # the owner still can
    assert a.call(Op.RELEASE, {"leases": [lid]}, dl)["st"] == [Status.OK]
    assert a.call(Op.RELEASE, {"leases": [lid]}, dl)["st"] == [Status.BAD_REQUEST]
    assert a.call(Op.COMMIT, {"slots": [sid], "abort": []}, dl)["st"] == [Status.OK]
    # malformed control headers are frame errors: that connection closes, the server lives
    with pytest.raises(onesided._FrameStatus):
        b.call(Op.RELEASE, {"leases": "nope"}, dl)
    with pytest.raises(onesided._FrameStatus):
        _raw(addr).call(Op.LEASE, {"ns": b"default", "items": [[b"a", -1]]}, dl)
    a.close()
    b.close()
    with Client([addr]) as c:
        assert c.get("a") == b"x" * 5000
        assert c.get("n") == b"0123456789"  # committed by its owner


def test_uncommitted_alloc_is_never_visible_and_close_aborts(trusted):
    addr = trusted.addresses[0]
    t = _raw(addr)
    dl = time.monotonic() + 5
    st, off, sid = t.call(Op.ALLOC, {"ns": b"default", "items": [
        [b"p", 4, 0, 4, 0, checksum(b"abcd")]]}, dl)["items"][0]
    assert st == Status.OK
    _write_arena(t, off, b"abcd")
    with Client([addr]) as c:
        assert c.get("p") is None and c.exists("p") is False
        t.close()  # abort on close
        time.sleep(0.2)
        assert c.get("p") is None


def test_lease_expires(make_cluster, monkeypatch):
    monkeypatch.setenv("GCACHE_SHM_LEASE_MS", "300")
    c = make_cluster(1, "32MiB", slab="4MiB")
    addr = c.addresses[0]
    with Client([addr]) as cl:
        assert cl.put("a", b"v" * 100) == Status.OK
    t = _raw(addr)
    dl = time.monotonic() + 5
    lid = t.call(Op.LEASE, {"ns": b"default", "items": [[b"a", 0]]}, dl)["items"][0][4]
    time.sleep(1.2)
    assert t.call(Op.RELEASE, {"leases": [lid]}, time.monotonic() + 5)["st"] == [
        Status.TIMEOUT]
    t.close()


def test_dead_or_hung_server_is_a_timely_miss(srv):
    addr = srv.addresses[0]
    with Client([addr], transport="shm", timeout_ms=800) as c:
        v = _value(2 << 20, 3)
        assert c.put("k", v) == Status.OK
        srv.servers[0].pause()  # hung: the control RPC times out
        t0 = time.monotonic()
        assert c.get("k") is None
        assert c.put("k2", v) != Status.OK
        assert time.monotonic() - t0 < 4
        srv.servers[0].resume()
        out: list = []
        th = threading.Thread(target=lambda: out.append(
            c.get_batch_into(["k"] * 8, [np.zeros(2 << 20, np.uint8) for _ in range(8)])))
        th.start()
        srv.servers[0].kill9()  # dies mid-operation
        th.join(5)
        assert not th.is_alive()
        t0 = time.monotonic()
        assert c.get("k") is None
        assert time.monotonic() - t0 < 2


def test_transport_timeout_before_copy(srv):
    t = _raw(srv.addresses[0])
    w = Work(Op.GET, b"default", [GetItem(b"zz", 0, 10, 0, None)], time.monotonic() - 1, None)
    with pytest.raises(TransportTimeout):
        t.execute(w)
    t.close()


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_hot_set_read_through_leases_survives_put_pressure(make_cluster, transport):
    """A LEASE is a read: it refreshes recency, so a hot set read over shm stays cached
    under write pressure exactly as it does when read over TCP."""
    c = make_cluster(1, "64MiB", slab="1MiB")
    v = _value(256 << 10, 3).tobytes()
    hot = [f"hot{i}" for i in range(8)]
    with Client(c.addresses, transport=transport, timeout_ms=10_000) as cl:
        assert cl.put_batch(hot, [v] * 8) == [Status.OK] * 8
        for r in range(40):  # 40 x 16 x 256 KiB = 160 MiB of cold puts, 2.5x the arena
            cl.put_batch([f"cold{r}_{i}" for i in range(16)], [v] * 16)
            got = cl.get_batch(hot)
        assert got == [v] * 8
        assert cl.exists("cold0_0") is False  # the pressure did evict


def test_release_without_waiting_then_other_ops_on_the_same_connection(srv):
    """A GET whose copies end well within the lease bound sends RELEASE without waiting;
    its reply is read before the next request, and the lease is really released."""
    addr = srv.addresses[0]
    v = _value(1 << 20, 11).tobytes()
    with Client([addr], transport="tcp") as c:
        assert c.put("r", v) == Status.OK
    t = _raw(addr)
    dst = bytearray(len(v))
    res = t.execute(Work(Op.GET, b"default", [GetItem(b"r", 0, len(v), 0, memoryview(dst))],
                         time.monotonic() + 5, None))
    assert res[0].status == Status.OK and bytes(dst) == v
    assert t.unread == 1  # the RELEASE reply is still on the wire
    ex = t.execute(Work(Op.EXISTS, b"default", [KeyItem(b"r"), KeyItem(b"nope")], time.monotonic() + 5, None))
    assert [r.status for r in ex] == [Status.OK, Status.MISS] and t.unread == 0
    res = t.execute(Work(Op.GET, b"default", [GetItem(b"r", 0, len(v), 0, None)],
                         time.monotonic() + 5, None))
    assert bytes(res[0].data) == v
    _fill(addr, 300 << 20)  # ~3x the arena: an unreleased lease would keep "r" cached
    with Client([addr], transport="tcp") as c:
        assert c.exists("r") is False
    t.close()


def test_small_frames_go_as_plain_round_trips(srv):
    """One control round trip + a copy costs more than one plain GET/PUT for a small
    frame: below one_sided_min_bytes the shm lane sends the plain op."""
    addr = srv.addresses[0]
    v = _value(65536, 21)
    with Client([addr], transport="shm", timeout_ms=10_000) as c:
        before = dict(onesided.STATS)
        assert c.put_batch_from(["s1"], [v]) == [Status.OK]
        out = np.zeros(65536, np.uint8)
        assert c.get_batch_into(["s1"], [out]) == [Status.OK] and np.array_equal(out, v)
        d = {k: onesided.STATS[k] - before[k] for k in before}
        assert d["small_frame_tcp_items"] == 2 and d["shm_get_items"] == 0 \
            and d["shm_put_items"] == 0
        keys = [f"b{i}" for i in range(8)]  # 8 x 64 KiB = 512 KiB: one-sided
        assert c.put_batch_from(keys, [v] * 8) == [Status.OK] * 8
        outs = [np.zeros(65536, np.uint8) for _ in keys]
        assert c.get_batch_into(keys, outs) == [Status.OK] * 8
        d = {k: onesided.STATS[k] - before[k] for k in before}
        assert d["shm_get_items"] == 8 and d["shm_put_items"] == 8


def test_one_sided_min_bytes_1_makes_every_frame_one_sided(srv, monkeypatch):
    monkeypatch.setenv("GCACHE_ONE_SIDED_MIN_BYTES", "1")
    with Client(srv.addresses, transport="shm", timeout_ms=10_000) as c:
        before = dict(onesided.STATS)
        assert c.put("tiny", b"x") == Status.OK and c.get("tiny") == b"x"
        out = bytearray(1)
        assert c.get_batch_into(["tiny"], [out]) == [Status.OK] and out == b"x"
        d = {k: onesided.STATS[k] - before[k] for k in before}
        assert d["small_frame_tcp_items"] == 0 and d["shm_put_items"] == 1 \
            and d["shm_get_items"] == 2
