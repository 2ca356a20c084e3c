"""Every master down during a handoff: server A drains under a rate cap while the oracle
reads and writes, and all three masters are stopped in the middle of A's pass. The
handoff goes on without them (A empties), and foreground reads and writes keep working
on the last view (no miss, no wrong value, writes acknowledged). The masters back, A
reports the handoff finished; every key acknowledged before and during reads back."""

from __future__ import annotations

import signal
import time

import pytest

from chaosops import evictions, quiet_load, report
from gcache.sdk import Client
from gcache.testing.waiting import wait_for
from handoffops import TOKEN, handoff_done, masters, member, read_back, start_cluster

pytestmark = [pytest.mark.integration, pytest.mark.serial, pytest.mark.faults, pytest.mark.timeout(120)]

SIZE = 16_000
N = 600  # 9.6 MB over 3 servers: A's 3.2 MB take about 3 s at 1 MB/s


def test_handoff_goes_on_with_every_master_down(make_cluster):
    cl = start_cluster(make_cluster, 3, "32MiB", slab="1MiB",
                       server_extra=["--migrate-mbps", "1"])
    keys = [f"m-{i}".encode() for i in range(N)]
    a = cl.servers[0]
    with Client(masters=cl.master_addresses, token=TOKEN, timeout_ms=5000) as c, \
            Client([a.address], token=TOKEN) as direct:
        load, t0 = quiet_load(c, 3, keys, SIZE)
        try:
            t_change = time.monotonic()
            epoch = masters(cl).admin("drain", a.name)["epoch"]
            wait_for(lambda: c.view.epoch >= epoch, 10)
            wait_for(lambda: member(cl, a.name)["stats"]["handoff_bytes_moved"] > 0, 20)
            for m in cl.masters:  # all at once: the pass is short
                m.proc.send_signal(signal.SIGTERM)
            for m in cl.masters:
                m.terminate()
            t_down = time.monotonic()
            held = direct.stats()[a.address]["objects"]
            written = len(load.written)
            # the handoff goes on: A empties with no master up
            wait_for(lambda: direct.stats()[a.address]["objects"] == 0, 30)
            t_empty = time.monotonic()
            time.sleep(0.5)
            writes_down = len(load.written) - written
            for m in cl.masters:
                m.start()
            wait_for(lambda: handoff_done(member(cl, a.name), epoch), 30)
            t_end = time.monotonic()
        finally:
            load.stop()
        acked = keys + load.written
        final = read_back(c, acked, SIZE)
        r = report("every master down mid-handoff", load, final, acked, set(), (t0, t_change),
                   (t_change, t_end))
        print(f"masters down {t_empty - t_down:.1f}s while A handed off {held} objects; "
              f"{writes_down} writes acknowledged meanwhile")
    assert held > 0, "the masters went down mid-pass"
    assert writes_down > 0, "writes go on with every master down"
    assert r.wrong == 0 and load.misses == 0 and evictions(cl.addresses) == 0, r
    assert final.missing == [] and r.retention == 1.0, r
    row = member(cl, a.name)
    assert row["state"] == "draining" and row["stats"]["handoff_lost"] == 0
