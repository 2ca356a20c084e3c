"""The wire STATS (``Client.stats()``) carries the handoff numbers the heartbeats and
/metrics have: after a drain, the drained server's STATS shows what it moved (the same
count its heartbeat brought to the masters), nothing left, and its self-drain reason."""

from __future__ import annotations

import pytest

from gcache.sdk import Client
from gcache.testing.waiting import wait_for
from handoffops import TOKEN, handoff_done, masters, member, put_all, start_cluster

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

FIELDS = ("handoff_objects_moved", "handoff_bytes_moved", "handoff_objects_left",
          "handoff_bytes_left", "handoff_waiting", "handoff_lost", "handoff_passes",
          "handoff_active", "handoff_epoch", "self_drain")


def test_stats_shows_handoff_fields_after_a_drain(make_cluster):
    cl = start_cluster(make_cluster, 2, "16MiB", slab="1MiB")
    gone = cl.servers[0]
    keys = [f"s-{i}".encode() for i in range(200)]
    with Client(masters=cl.master_addresses, token=TOKEN, timeout_ms=5000) as c:
        put_all(c, keys, 4000)
        for addr, st in c.stats().items():
            assert all(f in st for f in FIELDS), (addr, sorted(st))
            assert st["self_drain"] == "" and st["handoff_lost"] == 0
        epoch = masters(cl).admin("drain", gone.name)["epoch"]
        row = wait_for(lambda: (lambda r: r if handoff_done(r, epoch) else None)(
            member(cl, gone.name)), 30)
    with Client([gone.address], token=TOKEN) as direct:
        st = direct.stats()[gone.address]
    moved = row["stats"]["handoff_objects_moved"]
    assert moved > 50 and st["handoff_objects_moved"] == moved
    assert st["handoff_bytes_moved"] == moved * 4000
    assert st["handoff_objects_left"] == 0 and st["handoff_passes"] >= 1
    assert st["handoff_epoch"] >= epoch and st["objects"] == 0
