"""A handoff put (``"ia": 1``) never brings back a key deleted at its owner: the server
remembers recent deletes (``server/tombstones.py``) and skips an if-absent put of such a
key (OK, counted in ``put_if_absent_tombstoned``) until the tombstone expires; plain puts
are never blocked. The wire flag is driven directly, as a handoff worker sends it."""

from __future__ import annotations

import time
import urllib.request

import pytest

from gcache.clock import VirtualClock
from gcache.hashing import checksum
from gcache.protocol import Limits, Op
from gcache.sdk import Client, Status
from gcache.sdk.transports.base import GetItem, KeyItem, PutItem, Work
from gcache.sdk.transports.tcp import TcpTransport
from gcache.server.handoff import PUT_TIMEOUT_MS
from gcache.server.tombstones import Tombstones
from gcache.testing.cluster import Cluster, free_port
from gcache.testing.oracle import value_for
from gcache.testing.waiting import wait_for

NS = b"default"
REQUEST_TIMEOUT_MS = 1000
TTL_S = 2 * PUT_TIMEOUT_MS / 1000 + REQUEST_TIMEOUT_MS / 1000  # as the server computes it


def _work(op: int, items: list, **flags) -> Work:
    return Work(op, NS, items, time.monotonic() + 5, None, flags or None)


def _put(t: TcpTransport, key: bytes, v: bytes, **flags) -> Status:
    item = PutItem(key, len(v), 0, len(v), 0, memoryview(v), checksum(v), 0)
    return t.execute(_work(Op.PUT, [item], **flags))[0].status


def _get(t: TcpTransport, key: bytes) -> bytes | None:
    r = t.execute(_work(Op.GET, [GetItem(key, 0, 1 << 20, 0, None, 0)]))[0]
    return bytes(r.data) if r.status == Status.OK else None


def _delete(t: TcpTransport, key: bytes) -> Status:
    return t.execute(_work(Op.DELETE, [KeyItem(key, 0)]))[0].status


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_if_absent_put_after_a_delete_is_skipped_until_the_tombstone_expires(tmp_path):
    mport = free_port()
    with Cluster(1, "16MiB", slab="1MiB", log_dir=str(tmp_path),
                 extra=["--request-timeout-ms", str(REQUEST_TIMEOUT_MS),
                        "--metrics-listen", f"127.0.0.1:{mport}"]) as cl:
        t = TcpTransport(cl.addresses[0], "", Limits(), 5.0)
        c = Client(cl.addresses, timeout_ms=5000)
        try:
            old, new = value_for(b"k", 3000), value_for(b"handoff-k", 3000)
            assert _put(t, b"k", old) == Status.OK
            assert _delete(t, b"k") == Status.OK
            # the handoff copy arrives after the delete: skipped, answered OK
            assert _put(t, b"k", new, ia=1) == Status.OK
            assert _get(t, b"k") is None
            # a key deleted here while absent (the handoff had not arrived yet) too
            assert _delete(t, b"never") == Status.MISS
            assert _put(t, b"never", new, ia=1) == Status.OK
            assert _get(t, b"never") is None
            # an if-absent put of a key never deleted publishes as before
            assert _put(t, b"fresh", new, ia=1) == Status.OK
            assert _get(t, b"fresh") == new
            st = c.stats()[cl.addresses[0]]
            assert st["put_if_absent_tombstoned"] == 2
            assert st["tombstones"] == 2
            body = urllib.request.urlopen(f"http://127.0.0.1:{mport}/metrics",
                                          timeout=5).read().decode()
            assert "gcache_put_if_absent_tombstoned_total 2.0" in body
            assert "gcache_tombstones 2.0" in body
            # a plain put after a delete is never blocked, and the tombstone outlives it
            assert _delete(t, b"p") == Status.MISS
            assert _put(t, b"p", old) == Status.OK
            assert _get(t, b"p") == old
            assert _delete(t, b"p") == Status.OK
            assert _put(t, b"p", new, ia=1) == Status.OK
            assert _get(t, b"p") is None
            # once the tombstone expired, an if-absent put publishes again
            time.sleep(TTL_S)
            wait_for(lambda: _put(t, b"k", new, ia=1) == Status.OK and _get(t, b"k") == new,
                     5)
            assert c.stats()[cl.addresses[0]]["put_if_absent_tombstoned"] == 3
        finally:
            c.close()
            t.close()


@pytest.mark.unit
@pytest.mark.timeout(10)
def test_tombstones_expire_and_a_full_table_blocks_everything_its_cap_dropped():
    clock = VirtualClock()
    tb = Tombstones(ttl_s=10.0, max_entries=3, clock=clock)
    tb.deleted(NS, b"a")
    assert tb.blocks(NS, b"a") and not tb.blocks(NS, b"b")
    clock.advance(10.0)
    assert not tb.blocks(NS, b"a")  # expired
    for k in (b"b", b"c", b"d"):
        tb.deleted(NS, k)
    assert tb.stats()["tombstones"] == 3  # "a" trimmed as expired, not by the cap
    assert not tb.blocks(NS, b"zz")
    clock.advance(1.0)
    tb.deleted(NS, b"e")  # over the cap: "b" (1 s old) is dropped before its time
    assert tb.stats()["tombstones"] == 3
    # so every if-absent put is skipped until "b" would have expired
    assert tb.blocks(NS, b"b") and tb.blocks(NS, b"zz")
    clock.advance(9.5)
    assert not tb.blocks(NS, b"zz") and not tb.blocks(NS, b"b")
    assert tb.blocks(NS, b"e")
    # a frame's guard: only a delete at or after the frame started counts afterwards
    g = tb.guard(NS)
    assert g.skip(b"e") and not g.skip(b"q")
    assert not tb.blocks(NS, b"q", g.since)
    clock.advance(0.1)
    tb.deleted(NS, b"q")
    assert tb.blocks(NS, b"q", g.since)
