"""A server restart under a live client: pooled connections that died while idle are
replaced at once (no miss, no suspect period); with nixl the client attaches to the
server's new NIXL agent. A server that stays down is still a timely miss."""

from __future__ import annotations

import os
import time

import pytest

from gcache.nixl_lib import available
from gcache.sdk import Client, Status
from gcache.sdk.transports import onesided

pytestmark = pytest.mark.integration
TRANSPORTS = ["tcp", "shm"] + ([] if available() else ["nixl"])


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_restart_reconnects_without_misses(make_cluster, transport):
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    c = make_cluster(1, "96MiB", slab="8MiB", extra=["--nixl", "on"])
    v = os.urandom(1 << 20)
    with Client(c.addresses, transport=transport, timeout_ms=3000) as cl:
        for i in range(8):  # warm every pooled connection
            assert cl.put(f"k{i}", v) == Status.OK
        assert cl.get_batch([f"k{i}" for i in range(8)]) == [v] * 8
        before = onesided.STATS[f"{transport}_connections"]
        s = c.servers[0]
        s.kill9()
        s.restart()  # same name: the arena and its objects survive
        for i in range(8):  # every op succeeds, first try, on fresh connections
            assert cl.get(f"k{i}") == v
            assert cl.put(f"n{i}", b"z" * 70000) == Status.OK
            assert cl.get(f"n{i}") == b"z" * 70000
        if transport != "tcp":
            assert onesided.STATS[f"{transport}_connections"] > before
        s.kill9()  # and down for good: a timely miss, not a hang
        t0 = time.monotonic()
        assert cl.get("k0") is None
        assert time.monotonic() - t0 < 3.5
