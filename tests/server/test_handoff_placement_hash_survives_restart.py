"""The placement hash each object was put with survives a server restart, in both tiers
(after a clean stop: the arena and the disk's index file; after ``kill -9``: their
scans). The restarted server keeps all of them (its join-handoff pass, placing by the
stored hashes, finds it still owns them; by key hash it would push most away), is then
drained and removed, and a fresh client reads every grouped key byte-exact at its
group's owner."""

from __future__ import annotations

from collections import Counter

import pytest

from gcache.sdk import Client, Status
from gcache.testing.oracle import value_for
from gcache.testing.waiting import wait_for
from handoffops import (TOKEN, drain_and_wait, grouped_keys, handoff_done, masters, member,
                        read_back, remove, start_cluster, up_members)

pytestmark = [pytest.mark.integration, pytest.mark.serial, pytest.mark.timeout(180)]

SIZE = 16_000
N = 1800  # 29 MB over 3 servers of 8 MiB memory: part of each on disk


@pytest.mark.parametrize("how", ["sigterm", "kill9"])
def test_placement_hash_survives_restart_then_drain(make_cluster, tmp_path, how):
    cl = start_cluster(make_cluster, 3, "8MiB", slab="1MiB", extra=[
        "--disk-dir", str(tmp_path / "disk"), "--disk-bytes", "128MiB",
        "--segment-bytes", "4MiB"])
    gkeys, groups = grouped_keys(N, 60)
    with Client(masters=cl.master_addresses, token=TOKEN, timeout_ms=5000) as c:
        for i in range(0, N, 50):
            ks = gkeys[i:i + 50]
            st = c.put_batch(ks, [value_for(k, SIZE) for k in ks], group=groups[i:i + 50])
            assert st == [Status.OK] * len(ks)
        # the server owning the most grouped keys: at least a third of N, more than its
        # memory holds, so both of its tiers hold some (the ring's draw decides the
        # shares, as server ids are random, and the smallest may fit in memory alone)
        share = Counter(c.owners(gkeys, group=groups))
        gone = next(s for s in cl.servers if s.address == share.most_common(1)[0][0])
        moot = [k for k, a, b in zip(gkeys, c.owners(gkeys, group=groups), c.owners(gkeys))
                if a == gone.address and b != gone.address]
        assert moot, "no grouped key would move wrong by key hash: test is moot"
    with Client([gone.address], token=TOKEN) as direct:
        # both tiers hold grouped keys (demotion runs in the background)
        seen: list[dict] = []

        def both_tiers() -> bool:
            seen.append(direct.stats()[gone.address])
            return seen[-1]["objects"] > 10 and seen[-1]["disk_objects"] > 0
        try:
            wait_for(both_tiers, 30)
        except AssertionError as exc:
            raise AssertionError(f"{exc}; {share[gone.address]} of {N} keys owned, "
                                 f"stats {seen[-1:]}") from None
        held = (lambda st: st["objects"] + st["disk_objects"])(direct.stats()[gone.address])
    if how == "kill9":
        gone.kill9()
        gone.start()
    else:
        gone.restart()
    wait_for(lambda: gone.name in up_members(cl), 30)
    epoch = masters(cl).view()["epoch"]
    wait_for(lambda: handoff_done(member(cl, gone.name), epoch), 30)
    with Client([gone.address], token=TOKEN) as direct:
        st = direct.stats()[gone.address]
    # came back warm, in both tiers, and its join-handoff pass (placing by the stored
    # hashes) found nothing of its own to move away (a pass at a view that left it out
    # while it re-registered may have copied some out, never deleting them here)
    assert st["objects"] > 0 and st["disk_objects"] > 0
    assert st["objects"] + st["disk_objects"] == held, (st, held)
    drain_and_wait(cl, gone)
    remove(cl, gone)
    with Client(masters=cl.master_addresses, token=TOKEN, timeout_ms=5000) as fresh:
        got = read_back(fresh, gkeys, SIZE, groups=groups)
        assert got.wrong == [] and got.missing == [], (len(got.missing), got.wrong[:3])
        assert fresh.counters["handoff_reads"] == 0
