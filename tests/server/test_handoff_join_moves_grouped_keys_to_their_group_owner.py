"""Join 3 -> 4 with the default ``handoff_on_join`` (on): the old owners push the
newcomer its slice by each object's stored placement hash, so grouped keys (``group=``,
one per key) whose group the new ring gives the newcomer move there, together, and the
rest stay; afterwards a fresh client (no previous ring to fall back to) reads every key
byte-exact where its group routes it."""

from __future__ import annotations

import pytest

from gcache.sdk import Client, Status
from gcache.testing.oracle import value_for
from handoffops import (TOKEN, grouped_keys, join_and_wait, put_all, read_back,
                        start_cluster)

pytestmark = [pytest.mark.integration, pytest.mark.serial, pytest.mark.timeout(120)]

SIZE = 2000
N = 600


def test_join_moves_grouped_keys_to_their_group_owner(make_cluster):
    cl = start_cluster(make_cluster, 3, "32MiB", slab="1MiB")
    plain = [f"k-{i}".encode() for i in range(N)]
    gkeys, groups = grouped_keys(N, 40)
    olds = list(cl.servers)
    with Client(masters=cl.master_addresses, token=TOKEN, timeout_ms=5000) as c:
        put_all(c, plain, SIZE)
        st = c.put_batch(gkeys, [value_for(k, SIZE) for k in gkeys], group=groups)
        assert st == [Status.OK] * N, st
        new = join_and_wait(cl, c)  # the old owners' passes at its epoch done
        to_new = {k for k, a in zip(gkeys, c.owners(gkeys, group=groups)) if a == new.address}
        by_key = {k for k, a in zip(gkeys, c.owners(gkeys)) if a == new.address}
        assert to_new and to_new != by_key, "the groups moved as the keys would: moot"
        plain_new = sum(a == new.address for a in c.owners(plain))
    with Client(masters=cl.master_addresses, token=TOKEN, timeout_ms=5000) as fresh:
        for got in (read_back(fresh, plain, SIZE), read_back(fresh, gkeys, SIZE, groups=groups)):
            assert got.wrong == [] and got.missing == [], (len(got.missing), got.wrong[:3])
        assert fresh.counters["handoff_reads"] == 0  # every hit at the key's owner
    with Client([s.address for s in cl.servers], token=TOKEN) as direct:
        stats = direct.stats()
    # the newcomer holds exactly its slice: whole groups, plus the plain keys it owns
    assert stats[new.address]["objects"] == len(to_new) + plain_new
    assert sum(stats[s.address]["objects"] for s in olds) == 2 * N - len(to_new) - plain_new
