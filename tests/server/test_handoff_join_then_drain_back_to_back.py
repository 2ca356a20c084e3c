"""Two membership changes back to back: a 4th server joins (its slice handed over with
``--handoff-on-join``, under a rate cap) and, before that handoff finishes, another
server is drained, while the oracle reads and writes. No value is wrong, no read misses
(a key not moved yet is found at the member that held it two rings ago), and once both
handoffs are done every key acknowledged before the changes, and during them, reads
back; the drained server ends empty."""

from __future__ import annotations

import time

import pytest

from chaosops import evictions, quiet_load, report
from gcache.sdk import Client
from gcache.testing.waiting import wait_for
from handoffops import (TOKEN, add_server, handoff_done, masters, read_back, start_cluster,
                        up_members)

pytestmark = [pytest.mark.integration, pytest.mark.serial, pytest.mark.timeout(120)]

SIZE = 16_000
N = 600  # 9.6 MB over 3 servers: a quarter moves to the newcomer, 0.8 MB each at 1 MB/s


def test_join_then_drain_back_to_back_keeps_every_key(make_cluster):
    cl = start_cluster(make_cluster, 3, "32MiB", slab="1MiB",
                       server_extra=["--handoff-on-join", "true", "--migrate-mbps", "1",
                                     # the copies stay for the readers' 5 s deadline
                                     "--handoff-grace-ms", "5000"])
    keys = [f"b-{i}".encode() for i in range(N)]
    olds = list(cl.servers)
    gone = olds[1]
    with Client(masters=cl.master_addresses, token=TOKEN, timeout_ms=5000) as c:
        load, t0 = quiet_load(c, 3, keys, SIZE)
        try:
            t_change = time.monotonic()
            new = add_server(cl, olds[0].name.rsplit("-", 1)[0] + "-new")
            wait_for(lambda: len(up_members(cl)) == 4, 30)
            # drain once the join's handoff (0.8 MB per old owner at 1 MB/s) is under way
            joining = wait_for(lambda: sum(
                m["stats"].get("handoff_objects_left", 0) for m in masters(cl).status()["members"]
                if m.get("stats", {}).get("handoff_active") and m["id"] != new.name), 20)
            epoch = masters(cl).admin("drain", gone.name)["epoch"]
            wait_for(lambda: c.view.epoch >= epoch, 10)

            def settled() -> bool:
                doc = masters(cl).status()
                rows = {m["id"]: m for m in doc["members"]}
                return (all(handoff_done(m, doc["epoch"]) for m in rows.values())
                        and rows[gone.name]["stats"]["objects"] == 0)

            wait_for(settled, 40)
            t_end = time.monotonic()
            time.sleep(0.5)
        finally:
            load.stop()
        acked = keys + load.written
        final = read_back(c, acked, SIZE)
        r = report("join then drain, back to back", load, final, acked, set(),
                   (t0, t_change), (t_change, t_end))
        print(f"the join's handoff had {joining} objects left when the drain began")
    assert r.wrong == 0 and evictions(cl.addresses) == 0
    assert final.missing == [] and r.retention == 1.0, r
    # none: a fallback read reaches the old owner within the reader's deadline, and the
    # old owner keeps each copy that long (a fixed 200 ms grace lost 1 of 9,056 reads in
    # a loaded CI run; one kept ring instead of several lost 252 of 10,944)
    assert load.misses == 0, f"{load.misses} of {load.reads} reads missed"
    assert gone.address not in {m.address for m in c.view.members}
    assert new.address in {m.address for m in c.view.members}
