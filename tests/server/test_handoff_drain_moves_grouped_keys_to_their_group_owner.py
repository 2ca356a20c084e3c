"""Drain 3 -> 2 with keys written under ``group=`` (one group per batch, and one per key,
as the SGLang plugin's ``chain`` placement does) and without: the drained server moves
each object to the owner of the placement hash it was put with, so once it is drained
and removed, a fresh client (no previous ring to fall back to) reads every key, grouped
or not, byte-exact from where its group routes it."""

from __future__ import annotations

import pytest

from gcache.sdk import Client, Status
from gcache.testing.oracle import value_for
from handoffops import (TOKEN, drain_and_wait, grouped_keys, member, put_all, read_back,
                        remove, start_cluster)

pytestmark = [pytest.mark.integration, pytest.mark.serial, pytest.mark.timeout(120)]

SIZE = 3000
N = 600
BATCHES = 12  # of 25 keys, each batch one group


def test_drain_moves_grouped_keys_to_their_group_owner(make_cluster):
    cl = start_cluster(make_cluster, 3, "32MiB", slab="1MiB")
    plain = [f"k-{i}".encode() for i in range(N)]
    gkeys, groups = grouped_keys(N, 40)
    gone = cl.servers[0]
    with Client(masters=cl.master_addresses, token=TOKEN, timeout_ms=5000) as c:
        # batch groups: a third of them owned by the server to drain (by the real ring;
        # ids are random per run, so a fixed list could miss it)
        names = [f"batch-{j}" for j in range(20 * BATCHES)]
        on_gone = [g for g in names if c.owners([b"x"], group=g)[0] == gone.address]
        others = [g for g in names if g not in set(on_gone)]
        bgroups = on_gone[:BATCHES // 3] + others[:BATCHES - BATCHES // 3]
        assert len(bgroups) == BATCHES
        bkeys = [[f"b-{j}-{i}".encode() for i in range(25)] for j in range(BATCHES)]
        put_all(c, plain, SIZE)
        for i in range(0, N, 100):
            ks = gkeys[i:i + 100]
            st = c.put_batch(ks, [value_for(k, SIZE) for k in ks], group=groups[i:i + 100])
            assert st == [Status.OK] * len(ks)
        for j, ks in enumerate(bkeys):
            st = c.put_batch(ks, [value_for(k, SIZE) for k in ks], group=bgroups[j])
            assert st == [Status.OK] * len(ks)
        # the drained server holds grouped keys whose own key hash routes elsewhere
        mine = [k for k, a, b in zip(gkeys, c.owners(gkeys, group=groups), c.owners(gkeys))
                if a == gone.address and b != gone.address]
        assert mine, "no grouped key would move wrong by key hash: test is moot"
    drain_and_wait(cl, gone)
    assert member(cl, gone.name)["stats"]["handoff_lost"] == 0
    remove(cl, gone)
    with Client(masters=cl.master_addresses, token=TOKEN, timeout_ms=5000) as fresh:
        assert gone.address not in {m.address for m in fresh.view.members}
        for got in (read_back(fresh, plain, SIZE), read_back(fresh, gkeys, SIZE, groups=groups),
                    *(read_back(fresh, ks, SIZE, groups=bgroups[j])
                      for j, ks in enumerate(bkeys))):
            assert got.wrong == [] and got.missing == [], (len(got.missing), got.wrong[:3])
        assert fresh.counters["handoff_reads"] == 0  # every hit at the key's owner
        with Client([s.address for s in cl.servers if s is not gone], token=TOKEN) as direct:
            stats = direct.stats()
        assert sum(st["objects"] for st in stats.values()) == 2 * N + 25 * BATCHES
