"""Join 3 -> 4: once the old owners' handoff passes at the new epoch finish, every key
reads back byte-exact, the keys the new ring gives the newcomer are held by it (and no
longer by their old owners), and an oracle reader running throughout never sees a wrong
value, nor a miss."""

from __future__ import annotations

import pytest

from gcache.sdk import Client
from gcache.testing.waiting import wait_for
from handoffops import (OracleLoad, TOKEN, add_server, handoff_done, masters, put_all,
                        read_back, start_cluster, up_members)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

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
            new = add_server(cl, olds[0].name.rsplit("-", 1)[0] + "-new")
            wait_for(lambda: len(up_members(cl)) == 4, 30)
            epoch = masters(cl).view()["epoch"]
            wait_for(lambda: c.view.epoch >= epoch, 10)
            # every old owner finished a pass at the new epoch with nothing left
            wait_for(lambda: all(handoff_done(m, epoch)
                                 for m in masters(cl).status()["members"]
                                 if m["id"] != new.name), 30)
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
        rows = {m["id"]: m["stats"] for m in masters(cl).status()["members"]}
        assert sum(rows[s.name]["handoff_objects_moved"] for s in olds) >= len(moved)
        assert all(rows[s.name]["handoff_lost"] == 0 for s in olds)
