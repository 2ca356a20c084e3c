"""A server killed (-9) and restarted under the same name while the oracle reads and
writes, 3 servers. While it is down its share is misses, every read batch within its
deadline, and nothing else misses; restarted, it serves its arena again (warm): every
key acknowledged before the kill reads back, and from the view that lists it again no
read misses (keys written elsewhere while it was away are found at their previous
owner): that view clears the client's suspicion of it at once, though the client's
``probe_interval_ms`` here is 30 s. No value is ever wrong."""

from __future__ import annotations

import time

import pytest

from chaosops import evictions, misses_in, quiet_load, report, share
from gcache.sdk import Client
from gcache.testing.waiting import wait_for
from handoffops import TOKEN, masters, member, read_back, start_cluster

pytestmark = [pytest.mark.integration, pytest.mark.serial, pytest.mark.faults, pytest.mark.timeout(120)]

SIZE = 16_000
N = 600
TIMEOUT_MS = 3000  # a read past it is a miss: a loaded machine must not make one
SUSPECT_S = 30.0  # the client's probe_interval_ms: a lane that failed stays suspect so long


def test_kill9_then_restart_under_its_name_misses_only_its_share_then_serves_warm(
        make_cluster):
    cl = start_cluster(make_cluster, 3, "32MiB", slab="1MiB")
    keys = [f"k-{i}".encode() for i in range(N)]
    a = cl.servers[0]
    with Client(masters=cl.master_addresses, token=TOKEN, timeout_ms=TIMEOUT_MS,
                probe_interval_ms=int(SUSPECT_S * 1000)) as c:
        load, t0 = quiet_load(c, 3, keys, SIZE)
        ns, before = c.namespace, c.view
        try:
            t_kill = time.monotonic()
            a.kill9()
            wait_for(lambda: a.address not in c.view.holders, 10)  # marked down
            time.sleep(1.0)
            a.start()  # same name, same port: its arena is back
            wait_for(lambda: a.address in {m.address for m in c.view.members}, 20)
            t_back = time.monotonic()
            # any master answers /status, a follower from its own log, which may lag by
            # an apply the leader's view the client already has
            wait_for(lambda: member(cl, a.name)["state"] == "up", 10)
            time.sleep(3.0)
        finally:
            load.stop()
        acked = keys + load.written
        final = read_back(c, acked, SIZE)
        with Client([a.address], token=TOKEN) as direct:
            recovered = direct.stats()[a.address]["recovered"]
        # no key is lost; while A was down its share missed
        r = report("kill -9, restart under the same name", load, final, keys, set(),
                   (t0, t_kill), (t_kill, t_back),
                   explained=share([before], ns, acked, a.name))
        after = misses_in(load, t_back)
        print(f"restart recovered {recovered} objects from the arena; "
              f"{after} misses once the client's view listed it again")
    assert r.wrong == 0 and evictions(cl.addresses) == 0
    assert r.misses > 0 and r.unexplained_misses == [], r.unexplained_misses[:5]
    worst = max(s for _, s, _ in load.lat)
    assert worst < TIMEOUT_MS / 1000 + 1.0, f"a read batch took {worst:.2f}s"
    assert recovered > 0
    assert final.missing == [] and r.retention == 1.0, r
    assert after == 0, "warm from the view that lists it again (suspicion cleared)"
    assert masters(cl).view()["epoch"] > before.epoch
