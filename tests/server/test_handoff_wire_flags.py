"""The handoff wire flags with real server processes.

``"ia": 1`` (put if absent): never replaces a value a server holds, in memory or on
disk; when it races a plain put, the plain put's value is what stays, whichever
committed first; a plain put after it replaces it. Over TCP and over shm's
PUT_STAGED. ``"ho": 1`` (handoff read): a server that no longer owns a key (drained
out of the ring) answers NOT_OWNER to a plain GET/EXISTS/LEASE but serves the key to
one with the flag, and deletes its copy on a DELETE with it. A flag of the wrong type is
a frame-level BAD_REQUEST.
"""

from __future__ import annotations

import re
import threading
import time
import urllib.request

import pytest

from gcache.discovery import MasterClient
from gcache.hashing import checksum, placement_hash
from gcache.protocol import Limits, Op, encode_frame
from gcache.sdk import Client, Status
from gcache.sdk.transports.base import GetItem, KeyItem, PutItem, Work
from gcache.sdk.transports.onesided import STATS
from gcache.sdk.transports.shm import ShmTransport
from gcache.sdk.transports.tcp import TcpTransport
from gcache.testing.cluster import Cluster
from gcache.testing.oracle import check_value as _check_value, value_for
from gcache.testing.waiting import wait_for
from rawwire import RawConn


def check_value(key: bytes, v) -> bool:
    """The oracle's value for ``key`` (a miss is not)."""
    return v is not None and _check_value(key, v)


pytestmark = [pytest.mark.integration]

NS = b"default"


def _other(key: bytes, n: int) -> bytes:
    """A value for ``key`` that is not the oracle's (what an if-absent put brings)."""
    return value_for(b"handoff-" + key, n)


def _stats(c: Client, address: str) -> dict:
    return c.stats()[address]


@pytest.mark.timeout(120)
def test_if_absent_put_never_replaces_a_held_value_memory_tier(tmp_path):
    with Cluster(1, "64MiB", slab="4MiB", log_dir=str(tmp_path)) as cl, \
            Client(cl.addresses, timeout_ms=5000, slice_bytes=1 << 20) as c:
        keys = [f"mem{i}".encode() for i in range(64)]
        assert c.put_batch(keys[:32], [value_for(k, 5000) for k in keys[:32]]) == \
            [Status.OK] * 32
        # 32 held, 32 absent: every if-absent put answers OK
        st = c.put_batch(keys, [_other(k, 5000) for k in keys], if_absent=True)
        assert st == [Status.OK] * 64
        got = c.get_batch(keys)
        assert all(check_value(k, v) for k, v in zip(keys[:32], got[:32]))  # kept
        assert got[32:] == [_other(k, 5000) for k in keys[32:]]  # stored: they were absent
        assert _stats(c, cl.addresses[0])["put_if_absent_skipped"] == 32
        # a plain put after an if-absent one replaces it as usual
        assert c.put_batch(keys[32:], [value_for(k, 5000) for k in keys[32:]]) == \
            [Status.OK] * 32
        assert all(check_value(k, v) for k, v in zip(keys, c.get_batch(keys)))
        # a sliced value (several frames) obeys the flag as a whole
        big = b"big"
        assert c.put(big, value_for(big, 3 << 20)) == Status.OK
        assert c.put(big, _other(big, 3 << 20), if_absent=True) == Status.OK
        assert check_value(big, c.get(big))


@pytest.mark.timeout(180)
def test_if_absent_put_never_replaces_a_value_on_disk(tmp_path):
    n, size = 48, 512 << 10  # 24 MiB through an 8 MiB memory tier: most keys are on disk
    with Cluster(1, "8MiB", slab="1MiB", log_dir=str(tmp_path),
                 extra=["--disk-dir", str(tmp_path / "disk"), "--disk", "256MiB",
                        "--segment-bytes", "8MiB"]) as cl, \
            Client(cl.addresses, timeout_ms=10000) as c:
        keys = [f"disk{i}".encode() for i in range(n)]
        for k in keys:
            assert c.put(k, value_for(k, size)) == Status.OK
        addr = cl.addresses[0]
        wait_for(lambda: _stats(c, addr)["disk_objects"] >= n // 2, 20)
        demoted = _stats(c, addr)["disk_objects"]
        for k in keys:
            assert c.put(k, _other(k, size), if_absent=True) == Status.OK
        s = _stats(c, addr)
        assert s["put_if_absent_skipped"] == n, (s["put_if_absent_skipped"], demoted)
        for k in keys:
            assert check_value(k, c.get(k)), k


@pytest.mark.timeout(180)
@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_plain_put_wins_a_race_with_an_if_absent_put(tmp_path, transport):
    """Both puts of every key acknowledged, in any commit order: the plain put's value
    stays (if it committed first the if-absent one was skipped; if it committed second
    it replaced it). shm: 400 KiB frames go as PUT_STAGED."""
    n, size = 3000, 4096
    staged = STATS["shm_staged_frames"]
    with Cluster(1, "64MiB", slab="1MiB", log_dir=str(tmp_path)) as cl, \
            Client(cl.addresses, timeout_ms=10000, transport=transport) as plain, \
            Client(cl.addresses, timeout_ms=10000, transport=transport) as handoff:
        keys = [f"race{i}".encode() for i in range(n)]
        results: dict[str, list] = {}
        first = n // 3  # the plain put surely commits first for these
        assert plain.put_batch(keys[:first], [value_for(k, size) for k in keys[:first]]) \
            == [Status.OK] * first

        def run(name: str, client: Client, values: list, ia: bool) -> None:
            out = []
            for a in range(0, n, 100):
                out += client.put_batch(keys[a:a + 100], values[a:a + 100], if_absent=ia)
            results[name] = out

        ts = [threading.Thread(target=run, args=("plain", plain,
                                                 [value_for(k, size) for k in keys], False)),
              threading.Thread(target=run, args=("ia", handoff,
                                                 [_other(k, size) for k in keys], True))]
        for t in ts:
            t.start()
        for t in ts:
            t.join(120)
        assert results["plain"] == [Status.OK] * n
        assert results["ia"] == [Status.OK] * n
        got = plain.get_batch(keys)
        bad = [k for k, v in zip(keys, got) if not check_value(k, v)]
        assert not bad, f"{len(bad)} keys lost the plain put's value, e.g. {bad[:3]}"
        skipped = _stats(plain, cl.addresses[0])["put_if_absent_skipped"]
        assert first <= skipped <= n
        if transport == "shm":
            assert STATS["shm_staged_frames"] > staged


@pytest.fixture
def drained(tmp_path):
    """Two servers with masters; keys put while both were up, then the owner of some of
    them drained: it holds keys it no longer owns. Frames are sent as a client that
    still routes by the view before the drain (``epoch``)."""
    # a handoff cap of 1 KB/s: the drained server's handoff worker keeps what it holds
    # for the length of the test (its first batch waits about a minute)
    cl = Cluster(2, "32MiB", slab="1MiB", masters=3, token="tok", log_dir=str(tmp_path),
                 server_extra=["--migrate-mbps", "0.001", "--metrics-listen", "127.0.0.1:0"])
    cl.start()
    try:
        mc = MasterClient(cl.master_addresses, "tok")
        wait_for(lambda: sum(m["state"] == "up" for m in mc.view()["members"]) == 2, 20,
                 retry_on=(Exception,))
        a, b = cl.servers
        with Client(masters=cl.master_addresses, token="tok", timeout_ms=5000) as c:
            keys = [f"ho{i}".encode() for i in range(200)]
            on_b = [k for k, o in zip(keys, c.owners(keys)) if o == b.address][:20]
            assert c.put_batch(on_b, [value_for(k, 3000) for k in on_b]) == \
                [Status.OK] * len(on_b)
            mc.admin("drain", b.name)
            wait_for(lambda: [m.id for m in c.view.members] == [a.name], 10)
            epoch = c.view.epoch - 1  # the view the keys were put under: b owned them
        yield cl, on_b, epoch
    finally:
        cl.close()


def _frame(op: int, items: list, epoch: int, keys: list[bytes], **flags) -> Work:
    extra = {"ep": epoch, "ph": [placement_hash(NS, k) for k in keys], **flags}
    return Work(op, NS, items, time.monotonic() + 5, None, extra)


@pytest.mark.timeout(120)
def test_handoff_read_served_by_a_non_owner(drained, tmp_path):
    cl, on_b, epoch = drained
    b = cl.servers[1]
    gets = [GetItem(k, 0, 1 << 20, 0, None, i) for i, k in enumerate(on_b)]
    ex = [KeyItem(k, i) for i, k in enumerate(on_b)]
    t = TcpTransport(b.address, "tok", Limits(), 2.0)
    try:
        # b answers NOT_OWNER to a plain read once it adopted the epoch that drained it
        wait_for(lambda: [r.status for r in t.execute(_frame(Op.GET, gets, epoch, on_b))]
                 == [Status.NOT_OWNER] * len(on_b), 10)
        assert [r.status for r in t.execute(_frame(Op.EXISTS, ex, epoch, on_b))] == \
            [Status.NOT_OWNER] * len(on_b)
        ho = t.execute(_frame(Op.GET, gets, epoch, on_b, ho=1))
        assert all(r.status == Status.OK and check_value(k, r.data)
                   for k, r in zip(on_b, ho))
        assert [r.status for r in t.execute(_frame(Op.EXISTS, ex, epoch, on_b, ho=1))] == \
            [Status.OK] * len(on_b)
        # a delete with the flag deletes the non-owner's copy; without it, NOT_OWNER
        gone = [KeyItem(on_b[-1], 0)]
        assert [r.status for r in t.execute(_frame(Op.DELETE, gone, epoch, on_b[-1:]))] == \
            [Status.NOT_OWNER]
        assert [r.status for r in t.execute(_frame(Op.DELETE, gone, epoch, on_b[-1:], ho=1))] \
            == [Status.OK]
        assert [r.status for r in t.execute(_frame(Op.EXISTS, gone, epoch, on_b[-1:], ho=1))] \
            == [Status.MISS]
        # the flag does not open writes: a plain PUT there is still NOT_OWNER
        v = value_for(on_b[0], 10)
        put = [PutItem(on_b[0], 10, 0, 10, 0, memoryview(v), checksum(v), 0)]
        assert [r.status for r in t.execute(_frame(Op.PUT, put, epoch, on_b[:1], ho=1))] \
            == [Status.NOT_OWNER]
    finally:
        t.close()
    # every TCP handoff read is counted: n GET hits, n EXISTS hits, 1 EXISTS miss
    url = re.search(r"metrics on (http://\S+/metrics)",
                    (tmp_path / f"{b.name}.log").read_text())[1]
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    n = len(on_b)
    assert f'gcache_handoff_reads_total{{result="hit"}} {float(2 * n)}' in text, text
    assert 'gcache_handoff_reads_total{result="miss"} 1.0' in text
    # the one-sided read (LEASE) takes the flag too
    live = on_b[:-1]  # the last one was deleted above
    s = ShmTransport(b.address, "tok", Limits(), 2.0, mode="shm")
    try:
        dest = [bytearray(3000) for _ in live]
        leases = [GetItem(k, 0, 3000, 0, memoryview(d), i)
                  for i, (k, d) in enumerate(zip(live, dest))]
        assert [r.status for r in s.execute(_frame(Op.GET, leases, epoch, live))] == \
            [Status.NOT_OWNER] * len(live)
        res = s.execute(_frame(Op.GET, leases, epoch, live, ho=1))
        assert [r.status for r in res] == [Status.OK] * len(live)
        assert all(check_value(k, d) for k, d in zip(live, dest))
    finally:
        s.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("op,flag,value", [(Op.GET, "ho", 2), (Op.EXISTS, "ho", "yes"),
                                           (Op.PUT, "ia", 7), (Op.PUT, "ia", b"\x01")])
def test_a_flag_of_the_wrong_type_is_bad_request(tmp_path, op, flag, value):
    with Cluster(1, "16MiB", slab="1MiB", log_dir=str(tmp_path)) as cl:
        t = TcpTransport(cl.addresses[0], "", Limits(), 2.0)
        try:
            key = b"k"
            items = {Op.GET: [GetItem(key, 0, 100, 0, None)], Op.EXISTS: [KeyItem(key)],
                     Op.PUT: [PutItem(key, 1, 0, 1, 0, memoryview(b"x"), checksum(b"x"))]}[op]
            ok = t.execute(Work(op, NS, items, time.monotonic() + 5, None, {flag: 1}))
            assert [r.status for r in ok] in ([Status.OK], [Status.MISS])  # 1 is fine
            res = t.execute(Work(op, NS, items, time.monotonic() + 5, None, {flag: value}))
            assert [r.status for r in res] == [Status.BAD_REQUEST]
        finally:
            t.close()


@pytest.mark.timeout(60)
def test_alloc_refuses_if_absent(tmp_path):
    """COMMIT carries no header to say "if absent": an ALLOC asking for it is refused
    (frame-level BAD_REQUEST), never silently published unconditionally."""
    with Cluster(1, "16MiB", slab="1MiB", log_dir=str(tmp_path),
                 extra=["--shm-trusted-writers", "true"]) as cl:
        conn = RawConn(cl.addresses[0])
        conn.auth()
        v = b"x" * 100
        conn.send(encode_frame(Op.ALLOC, 7, {"ns": NS, "items": [[b"k", 100, 0, 100, 0,
                                                                  checksum(v)]], "ia": 1}))
        assert "ALLOC" in conn.expect_error(Status.BAD_REQUEST, rid=7, opcode=Op.ALLOC)
