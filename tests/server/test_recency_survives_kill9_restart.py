"""The eviction order survives a crash (issue 14, item 2), with real processes: a server
with ``--recency-snapshot-ms 200`` holds 40 objects, the 8 oldest are read again, and
after a snapshot period it is killed (-9) and restarted under its name. The next puts
evict the objects nobody read (oldest first), never the 8 read ones; by creation time
alone (no snapshot) those 8 would go first."""

from __future__ import annotations

import time

import pytest

from gcache.sdk import Client, Status
from gcache.testing.oracle import check_value, value_for

pytestmark = [pytest.mark.integration, pytest.mark.faults, pytest.mark.timeout(60)]

SIZE = 200_000
N = 40
READ = 8


def _evictions(c: Client) -> int:
    return next(iter(c.stats().values()))["evictions"]


def test_eviction_order_after_kill9_is_the_one_before_the_crash(make_cluster) -> None:
    cl = make_cluster(1, "10MiB", slab="1MiB", extra=["--recency-snapshot-ms", "200",
                                                      "--high-watermark", "0.99",
                                                      "--low-watermark", "0.98"])
    srv = cl.servers[0]
    keys = [b"k%02d" % i for i in range(N)]
    with Client([srv.address], timeout_ms=10_000) as c:
        s = next(iter(c.stats().values()))
        assert N * 204_800 < 0.98 * s["capacity_bytes"] < (N + 8) * 204_800, s
        for i in range(0, N, 8):
            assert c.put_batch(keys[i:i + 8],
                               [value_for(k, SIZE) for k in keys[i:i + 8]]) == [Status.OK] * 8
        assert _evictions(c) == 0
        got = c.get_batch(keys[:READ])  # the oldest, read again: the hottest now
        assert all(v is not None and check_value(k, v) for k, v in zip(keys[:READ], got))
    time.sleep(0.8)  # > 2 snapshot periods (the evictor wakes every 0.2 s)
    srv.kill9()
    srv.start()
    new = [b"n%02d" % i for i in range(3 * READ)]
    with Client([srv.address], timeout_ms=10_000) as c:
        for k in new:  # one at a time until as many were evicted as were read
            assert c.put(k, value_for(k, SIZE)) == Status.OK
            if _evictions(c) >= READ:
                break
        gone = [k for k, here in zip(keys, c.exists_batch(keys)) if not here]
        assert len(gone) >= READ, gone
        assert all(c.exists_batch(keys[:READ])), f"read before the crash, yet evicted: {gone}"
        assert gone == keys[READ:READ + len(gone)], "not the coldest first"
