"""Join 3 -> 4 with ``--handoff-on-join false``: the old owners move nothing, and every
key, grouped or not, still reads back byte-exact through the SDK's previous-owner
fallback. (The default, on: test_handoff_join_moves_grouped_keys_to_their_group_owner.py.)"""

from __future__ import annotations

import pytest

from gcache.sdk import Client, Status
from gcache.testing.oracle import check_value, value_for
from handoffops import TOKEN, join_and_wait, put_all, read_back, start_cluster

pytestmark = [pytest.mark.integration, pytest.mark.serial, pytest.mark.timeout(120)]

SIZE = 2000
N = 600
GROUPS = [f"session-{i}" for i in range(40)]


def test_join_moves_nothing_and_grouped_keys_still_hit(make_cluster):
    cl = start_cluster(make_cluster, 3, "32MiB", slab="1MiB",
                       extra=["--handoff-on-join", "false"])
    keys = [f"k-{i}".encode() for i in range(N)]
    gkeys = [f"g-{i}".encode() for i in range(N)]
    groups = [GROUPS[i % len(GROUPS)] for i in range(N)]
    olds = list(cl.servers)
    with Client(masters=cl.master_addresses, token=TOKEN, timeout_ms=5000) as c:
        put_all(c, keys, SIZE)
        st = c.put_batch(gkeys, [value_for(k, SIZE) for k in gkeys], group=groups)
        assert st == [Status.OK] * N, st
        before = c.owners(gkeys, group=groups)
        new = join_and_wait(cl, c)  # the old owners' passes at its epoch done
        after = c.owners(gkeys, group=groups)
        assert any(a != b for a, b in zip(before, after)), "no group moved: test is moot"
        got = read_back(c, keys, SIZE)
        assert got.wrong == [] and got.missing == [] and got.ok == N
        vals = c.get_batch(gkeys, group=groups)
        assert all(v is not None and check_value(k, v) for k, v in zip(gkeys, vals)), \
            sum(v is None for v in vals)
        assert c.counters["handoff_read_hits"] > 0
        with Client([s.address for s in cl.servers], token=TOKEN) as direct:
            stats = direct.stats()
        assert stats[new.address]["objects"] == 0  # nothing was pushed to the newcomer
        assert sum(stats[s.address]["objects"] for s in olds) == 2 * N
