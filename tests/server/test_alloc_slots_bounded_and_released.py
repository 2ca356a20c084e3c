"""ALLOC reservations are bounded per connection, expire, and go when it closes.

Before the fix one connection's ALLOC slots never expired while it lived and had no
byte bound: 63 slots evicted every object and every other put got NO_SPACE. Now a
connection may hold at most a quarter of the arena in reservations (further items
answer BUSY), a slot expires after ``lease_ms`` (COMMIT answers TIMEOUT; its chunk is
quarantined, still charged to that connection, because its writer may still be
copying), and everything is freed when the connection closes.
"""

from __future__ import annotations

import time

import pytest

from gcache.hashing import checksum
from gcache.protocol import Op, encode_frame
from gcache.sdk import Client
from gcache.status import Status

from rawwire import RawConn

pytestmark = [pytest.mark.integration, pytest.mark.faults]

KIB = 1 << 10


def _stats(addr: str) -> dict:
    with Client([addr], transport="tcp", timeout_ms=5000) as c:
        return next(iter(c.stats().values()))


def _call(c: RawConn, op: int, rid: int, meta: dict) -> dict:
    c.send(encode_frame(op, rid, meta))
    fh, rep = c.read()
    assert fh.status == 0 and fh.request_id == rid, rep
    return rep


@pytest.mark.timeout(90)
def test_alloc_slots_bounded_and_released(make_cluster, monkeypatch):
    monkeypatch.setenv("GCACHE_SHM_LEASE_MS", "800")
    monkeypatch.setenv("GCACHE_SHM_TRUSTED_WRITERS", "true")  # ALLOC: a trusted writer
    cl = make_cluster(1, "64MiB", slab="1MiB")
    addr = cl.addresses[0]
    keep = [f"keep{i}" for i in range(24)]
    with Client([addr], transport="tcp", timeout_ms=5000) as w:
        assert w.put_batch(keep, [b"k" * (900 * KIB)] * 24) == [Status.OK] * 24
    c = RawConn(addr)
    c.auth()
    n = 900 * KIB
    items = [[b"slot%d" % i, n, 0, n, 0, checksum(b"%d" % i)] for i in range(63)]
    rep = _call(c, Op.ALLOC, 2, {"ns": b"a", "items": items})
    st = [x[0] for x in rep["items"]]
    ok = [x[2] for x in rep["items"] if x[0] == Status.OK]
    assert 0 < len(ok) <= 17 and st.count(Status.BUSY) == 63 - len(ok), st  # 904 KiB chunks
    assert _stats(addr)["reserved_bytes"] <= 16 << 20
    # nothing was evicted for them, and other writers still get space
    with Client([addr], transport="tcp", timeout_ms=5000) as w:
        assert all(v is not None for v in w.get_batch(keep))
        assert w.put("other", b"o" * (900 * KIB)) == Status.OK
    # slots expire: COMMIT answers TIMEOUT; the chunks stay charged to this connection
    time.sleep(2.5)
    assert _call(c, Op.COMMIT, 3, {"slots": ok[:1], "abort": []})["st"] == [Status.TIMEOUT]
    assert _stats(addr)["quarantined"] == len(ok)
    c.close()  # ...until it closes
    end = time.monotonic() + 5
    while (s := _stats(addr))["reserved_bytes"] and time.monotonic() < end:
        time.sleep(0.1)
    assert s["reserved_bytes"] == 0 and s["shm_slots"] == 0
