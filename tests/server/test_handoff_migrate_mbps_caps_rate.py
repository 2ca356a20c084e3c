"""``--migrate-mbps`` caps the handoff: a drain under a 2 MB/s cap moves its bytes at no
more than twice the cap (measured from the masters' view of its heartbeats: the first
sample with bytes moved to the first with nothing left), and loses nothing."""

from __future__ import annotations

import time

import pytest

from gcache.sdk import Client
from handoffops import TOKEN, handoff_done, masters, member, put_all, read_back, start_cluster

pytestmark = [pytest.mark.integration, pytest.mark.serial, pytest.mark.timeout(120)]

CAP_MBPS = 2.0
SIZE = 64_000
N = 120  # 7.7 MB over 2 servers: about 2 s of handoff at the cap


def test_migrate_mbps_caps_the_handoff_rate(make_cluster):
    cl = start_cluster(make_cluster, 2, "32MiB", slab="1MiB",
                       server_extra=["--migrate-mbps", str(CAP_MBPS)])
    keys = [f"r-{i}".encode() for i in range(N)]
    gone = cl.servers[0]
    with Client(masters=cl.master_addresses, token=TOKEN, timeout_ms=5000) as c:
        put_all(c, keys, SIZE, batch=16)
        with Client([gone.address], token=TOKEN) as direct:
            held = direct.stats()[gone.address]
        epoch = masters(cl).admin("drain", gone.name)["epoch"]
        samples = []  # (time, bytes moved) while the handoff runs
        end = time.monotonic() + 30
        while time.monotonic() < end:
            row = member(cl, gone.name)
            samples.append((time.monotonic(), row["stats"]["handoff_bytes_moved"]))
            if handoff_done(row, epoch):
                break
            time.sleep(0.05)
        else:
            pytest.fail(f"the drain did not finish: {row['stats']}")
        moved = samples[-1][1]
        assert held["objects"] > 20 and moved == held["objects"] * SIZE  # all it held
        first = next(t for t, b in samples if b > 0)
        last = next(t for t, b in samples if b == moved)
        # heartbeats sample every 200 ms
        rate = moved / max(last - first + 0.4, 1e-3) / 1e6
        assert rate <= 2 * CAP_MBPS, f"{rate:.2f} MB/s under a {CAP_MBPS} MB/s cap"
        assert last - first >= 0.5 * moved / (CAP_MBPS * 1e6)  # not trivially fast either
        got = read_back(c, keys, SIZE)
        assert got.wrong == [] and got.missing == [] and got.ok == N
