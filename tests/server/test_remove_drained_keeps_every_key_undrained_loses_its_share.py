"""``gcache admin remove`` under the oracle workload, 4 servers. A drained server,
stopped and removed: nothing is lost and no read misses. Then an undrained server
killed (-9) and removed at once: its share is gone, as misses that all belong to it
(every one timely), never a wrong value; every other key still reads back."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from chaosops import evictions, missed_between, quiet_load, report, share
from gcache.sdk import Client
from gcache.testing.waiting import wait_for
from handoffops import TOKEN, handoff_done, masters, member, read_back, start_cluster

pytestmark = [pytest.mark.integration, pytest.mark.serial, pytest.mark.faults, pytest.mark.timeout(120)]

SIZE = 16_000
N = 800
TIMEOUT_MS = 3000  # a read past it is a miss: a loaded machine must not make one


def _remove(cl, member_id: str) -> None:
    r = subprocess.run([sys.executable, "-m", "gcache.cli", "admin", "remove", member_id,
                        "--masters", ",".join(cl.master_addresses), "--token", TOKEN],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


def test_remove_drained_keeps_every_key_and_undrained_loses_only_its_share(make_cluster):
    cl = start_cluster(make_cluster, 4, "32MiB", slab="1MiB")
    keys = [f"r-{i}".encode() for i in range(N)]
    drained, killed = cl.servers[0], cl.servers[1]
    with Client(masters=cl.master_addresses, token=TOKEN, timeout_ms=TIMEOUT_MS) as c:
        load, t0 = quiet_load(c, 4, keys, SIZE)
        ns = c.namespace
        views = [c.view]
        try:
            t_change = time.monotonic()
            # 1. drained, stopped, removed: nothing lost
            epoch = masters(cl).admin("drain", drained.name)["epoch"]
            wait_for(lambda: handoff_done(member(cl, drained.name), epoch)
                     and member(cl, drained.name)["stats"]["objects"] == 0, 30)
            assert drained.terminate() == 0
            _remove(cl, drained.name)
            wait_for(lambda: all(m["id"] != drained.name
                                 for m in masters(cl).view()["members"]), 10)
            views.append(c.view)
            time.sleep(0.5)
            t_kill = time.monotonic()
            # 2. undrained, killed and removed at once: its share is gone
            killed.kill9()
            _remove(cl, killed.name)
            wait_for(lambda: killed.address not in c.view.holders, 10)
            time.sleep(1.5)
            t_end = time.monotonic()
        finally:
            load.stop()
        acked = keys + load.written
        final = read_back(c, acked, SIZE)
        lost = share(views, ns, acked, killed.name)
        r = report("remove drained, then remove undrained (killed)", load, final, keys, lost,
                   (t0, t_change), (t_change, t_end))
    assert r.wrong == 0 and evictions([s.address for s in cl.servers if s.alive]) == 0
    early = missed_between(load, t0, t_kill)  # batches that ended before the kill
    assert early == [], f"removing a drained server loses nothing: {early[:5]}"
    assert r.unexplained_missing == [] and r.retention == 1.0, r
    assert r.unexplained_misses == [], r.unexplained_misses[:5]
    assert 0 < r.misses and set(final.missing) <= lost
    worst = max(s for _, s, _ in load.lat)
    assert worst < TIMEOUT_MS / 1000 + 1.0, f"a read batch took {worst:.2f}s"
