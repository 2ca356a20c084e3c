"""Join 3 -> 4: once the old owners' handoff passes at the new epoch finish, every key
reads back byte-exact, the keys the new ring gives the newcomer are held by it (and no
longer by their old owners), and an oracle reader running throughout never sees a wrong
value, nor a miss."""

from __future__ import annotations

import pytest

from gcache.testing.waiting import wait_for
from gcache.sdk import Client
from handoffops import (OracleLoad, TOKEN, join_and_wait, masters, put_all, read_back,
                        start_cluster)

pytestmark = [pytest.mark.integration, pytest.mark.serial, pytest.mark.timeout(120)]

SIZE = 4000
N = 1500


def test_join_moves_the_newcomers_slice(make_cluster):
    cl = start_cluster(make_cluster, 3, "32MiB", slab="1MiB")  # handoff_on_join: default
    keys = [f"j-{i}".encode() for i in range(N)]
    olds = list(cl.servers)
    with Client(masters=cl.master_addresses, token=TOKEN, timeout_ms=5000) as c:
        put_all(c, keys, SIZE)
        load = OracleLoad(c, keys, SIZE, write=False).start()
        try:
            new = join_and_wait(cl, c)  # the old owners' passes at its epoch done
        finally:
            load.stop()
        moved = [k for k, a in zip(keys, c.owners(keys)) if a == new.address]
        assert 0.1 * N < len(moved) < 0.45 * N  # about a quarter
        got = read_back(c, keys, SIZE)
        # reads stay hits while the data moves (the SDK asks the previous owner on a miss)
        assert load.misses == 0, f"{load.misses} of {load.reads} reads missed"
        assert got.wrong == [] and load.wrong == [] and load.reads > 0
        assert got.missing == [] and got.ok == N
        with Client([s.address for s in cl.servers], token=TOKEN) as direct:
            st = direct.stats()
        assert st[new.address]["objects"] == len(moved)
        assert sum(st[s.address]["objects"] for s in olds) == N - len(moved)
        # a master that just became leader lists a member's stats from its next heartbeat
        rows = wait_for(lambda: (lambda r: r if all("handoff_objects_moved" in r[s.name]
                                                    for s in olds) else None)(
            {m["id"]: m.get("stats") or {} for m in masters(cl).status()["members"]}), 15)
        assert sum(rows[s.name]["handoff_objects_moved"] for s in olds) >= len(moved)
        assert all(rows[s.name]["handoff_lost"] == 0 for s in olds)
