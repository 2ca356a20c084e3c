"""The target killed mid-handoff: server A drains under a rate cap while the oracle runs,
and B, the survivor taking most of A's keys, is killed (-9) in the middle of A's pass.
What A had already handed to the other survivors stays; A keeps the objects it had not yet
handed to B (they count as waiting while B is dead but still in the view) and hands them
to their new owners once the masters mark B down; A ends empty. No value is ever wrong;
the only keys lost, and the only misses, are B's share (what B owned, and what A had
handed to it)."""

from __future__ import annotations

import time
from collections import Counter

import pytest

from chaosops import evictions, owner_ids, quiet_load, report, share
from gcache.sdk import Client
from gcache.testing.waiting import wait_for
from handoffops import TOKEN, handoff_done, masters, member, read_back, start_cluster

pytestmark = [pytest.mark.integration, pytest.mark.serial, pytest.mark.faults, pytest.mark.timeout(120)]

SIZE = 16_000
N = 800  # 12.8 MB over 4 servers: A's 3.2 MB take about 3 s at 1 MB/s


def test_target_killed_mid_handoff_loses_only_its_share(make_cluster):
    cl = start_cluster(make_cluster, 4, "32MiB", slab="1MiB",
                       server_extra=["--migrate-mbps", "1"])
    keys = [f"t-{i}".encode() for i in range(N)]
    a = cl.servers[0]
    with Client(masters=cl.master_addresses, token=TOKEN, timeout_ms=5000) as c:
        load, t0 = quiet_load(c, 4, keys, SIZE)
        ns, before = c.namespace, c.view
        a_keys = [k for k, o in zip(keys, owner_ids(before, ns, keys)) if o == a.name]
        try:
            t_change = time.monotonic()
            epoch = masters(cl).admin("drain", a.name)["epoch"]
            wait_for(lambda: c.view.epoch >= epoch, 10)
            drained = c.view
            target = dict(zip(a_keys, owner_ids(drained, ns, a_keys)))
            b_name = Counter(target.values()).most_common(1)[0][0]
            b = next(s for s in cl.servers if s.name == b_name)
            wait_for(lambda: member(cl, a.name)["stats"]["handoff_bytes_moved"] > 0, 20)
            b.kill9()
            left_at_kill = member(cl, a.name)["stats"]["handoff_objects_left"]
            waiting = 0  # the most objects A reported waiting (B dead, still in the view)
            end = time.monotonic() + 40
            while True:
                doc = masters(cl).status()
                row = next(m for m in doc["members"] if m["id"] == a.name)
                st = row.get("stats") or {}
                waiting = max(waiting, st.get("handoff_waiting", 0))
                b_down = all(m["id"] != b_name or m["state"] == "down" for m in doc["members"])
                if b_down and handoff_done(row, doc["epoch"]) and st["objects"] == 0:
                    break
                assert time.monotonic() < end, f"A did not finish its handoff: {row}"
                time.sleep(0.05)
            t_end = time.monotonic()
            time.sleep(0.5)  # the oracle reads on after the handoff
        finally:
            load.stop()
        acked = keys + load.written
        final = read_back(c, acked, SIZE)
        lost = share([before, drained], ns, acked, b_name)  # B's own, and what A gave it
        r = report("target killed mid-handoff", load, final, keys, lost, (t0, t_change),
                   (t_change, t_end))
    assert r.wrong == 0 and evictions([s.address for s in cl.servers if s.alive]) == 0
    assert r.unexplained_missing == [] and r.retention == 1.0, r
    assert r.unexplained_misses == [], r.unexplained_misses[:5]
    missing = set(final.missing)
    # A kept what it had not handed to B yet, and passed it on once B was down
    to_b = [k for k in a_keys if target[k] == b_name]
    kept = [k for k in to_b if k not in missing]
    assert left_at_kill > 0 and kept, (left_at_kill, len(to_b))
    assert waiting > 0, "A never reported the objects whose target died as waiting"
    # nothing A handed to the other survivors was lost
    assert not [k for k in a_keys if target[k] != b_name and k in missing]
    assert member(cl, a.name)["stats"]["handoff_lost"] == 0
