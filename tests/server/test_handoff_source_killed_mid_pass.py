"""The source killed mid-handoff: server A drains under a rate cap while the oracle runs,
and is killed (-9) in the middle of its pass, then restarted under the same name. What A
had handed off stays readable at its new owners; while A is down its remaining keys are
timely misses (its share, nothing else); restarted, A comes back draining with its arena,
readers find its keys there again (once their client's suspicion of A lapses,
``probe_interval_ms``), and its handoff resumes and finishes: every key acknowledged
before the drain reads back, none wrong, A ends empty."""

from __future__ import annotations

import time

import pytest

from chaosops import evictions, misses_in, owner_ids, quiet_load, report, share
from gcache.sdk import Client
from gcache.testing.waiting import wait_for
from handoffops import TOKEN, handoff_done, masters, member, read_back, start_cluster

pytestmark = [pytest.mark.integration, pytest.mark.serial, pytest.mark.faults, pytest.mark.timeout(120)]

SIZE = 16_000
N = 600  # 9.6 MB over 3 servers: A's 3.2 MB take about 3 s at 1 MB/s
SUSPECT_S = 1.0  # the client's probe_interval_ms: a lane that failed stays suspect so long


def test_source_killed_mid_pass_keeps_what_it_handed_off_and_resumes(make_cluster):
    cl = start_cluster(make_cluster, 3, "32MiB", slab="1MiB",
                       server_extra=["--migrate-mbps", "1"])
    keys = [f"s-{i}".encode() for i in range(N)]
    a = cl.servers[0]
    with Client(masters=cl.master_addresses, token=TOKEN, timeout_ms=5000) as c:
        load, t0 = quiet_load(c, 3, keys, SIZE)
        ns, before = c.namespace, c.view
        a_keys = {k for k, o in zip(keys, owner_ids(before, ns, keys)) if o == a.name}
        try:
            t_change = time.monotonic()
            masters(cl).admin("drain", a.name)
            wait_for(lambda: member(cl, a.name)["stats"]["handoff_objects_moved"] > 0, 20)
            moved = member(cl, a.name)["stats"]["handoff_objects_moved"]  # at least
            a.kill9()
            wait_for(lambda: member(cl, a.name)["state"] == "down", 10)
            time.sleep(0.5)  # A's keys miss, timely
            a.start()  # same name: its arena is back, and it is still drained
            wait_for(lambda: a.address in c.view.holders, 20)
            t_back = time.monotonic()
            assert member(cl, a.name)["state"] == "draining"
            end = time.monotonic() + 40
            while True:
                doc = masters(cl).status()
                row = next(m for m in doc["members"] if m["id"] == a.name)
                if handoff_done(row, doc["epoch"]) and row["stats"]["objects"] == 0:
                    break
                assert time.monotonic() < end, f"A did not finish its handoff: {row}"
                time.sleep(0.05)
            t_end = time.monotonic()
            time.sleep(max(0.5, t_back + SUSPECT_S + 1.5 - t_end))  # reads after the lapse
        finally:
            load.stop()
        acked = keys + load.written
        final = read_back(c, acked, SIZE)
        # no key is lost; while A was down its share missed
        r = report("source killed mid-handoff", load, final, keys, set(), (t0, t_change),
                   (t_change, t_end), explained=share([before], ns, acked, a.name))
    assert 0 < moved < len(a_keys), "A was killed mid-pass: some but not all handed off"
    assert r.wrong == 0 and evictions(cl.addresses) == 0
    assert final.missing == [] and r.retention == 1.0, r
    assert r.unexplained_misses == [], r.unexplained_misses[:5]
    assert misses_in(load, t_back + SUSPECT_S + 0.5) == 0, "back and draining, A serves again"
    assert member(cl, a.name)["stats"]["handoff_lost"] == 0
