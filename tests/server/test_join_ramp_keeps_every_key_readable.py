"""Join 3 -> 4 with a capacity ramp (masters with ``--join-ramp-s``): the newcomer is
JOINING from its first view, in the ring at a quarter of its weight, takes the writes of
its (small) slice at once, its ramp rises through the steps to full, and it turns UP
once the old owners finished handing off. An oracle reader and writer running
throughout never see a wrong value nor a miss: a key that moved several ramp steps ago
is still found at its previous owner (the SDK keeps the rings of the last views). With
the old owners' handoff held back (a trickle cap), the join stays JOINING after its ramp
is full, and only the join timeout ends it.

Real processes: 3 masters and 3 servers, then a 4th server joins.
"""

from __future__ import annotations

import threading
import time
from dataclasses import replace

import pytest

from gcache.hashing import placement_hash
from gcache.ring import Ring
from gcache.sdk import Client, Status
from gcache.testing.oracle import value_for
from gcache.testing.waiting import wait_for
from handoffops import (OracleLoad, TOKEN, add_server, masters, put_all, read_back,
                        start_cluster)

pytestmark = [pytest.mark.integration, pytest.mark.serial]

SIZE = 4000
N = 1200
RAMP_S = 6.0  # steps every 2 s: 0.25, 0.5, 0.75, 1.0


class JoinWatch:
    """Polls the masters' view: every (state, ramp) a member was seen in, in order."""

    def __init__(self, cl, member_id: str) -> None:
        self.mc, self.member_id = masters(cl), member_id
        self.seen: list[tuple[str, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            try:
                doc = self.mc.view()
            except Exception:  # a master election: try again
                continue
            m = next((m for m in doc["members"] if m["id"] == self.member_id), None)
            if m is not None:
                cur = (m["state"], m.get("ramp", 1.0))
                if not self.seen or self.seen[-1] != cur:
                    self.seen.append(cur)

    def state(self) -> str | None:
        return self.seen[-1][0] if self.seen else None

    def stop(self) -> list[tuple[str, float]]:
        self._stop.set()
        self._thread.join(10)
        return self.seen


def _writes_reach_the_joining_newcomer(c: Client, new) -> None:
    """Keys the newcomer owns while it ramps (weight below its full one) are put, and
    the newcomer itself holds them."""
    for attempt in range(5):
        fresh = [f"fresh-{attempt}-{i}".encode() for i in range(400)]
        v0 = c.view
        owners = c.owners(fresh)
        mine = [k for k, a in zip(fresh, owners) if a == new.address]
        assert c.put_batch(mine, [value_for(k, SIZE) for k in mine]) == [Status.OK] * len(mine)
        if c.view.epoch == v0.epoch:
            break
    weight = {m.id: m.weight for m in v0.members}[new.name]
    assert weight < 1.0, "the newcomer was already at full weight"
    # its ramped share, not its full one: a ramped member's vnodes are the first of its
    # full-weight ones, so it owns a strict subset of what it owns at weight 1 (a fixed
    # cut such as a fifth of the keys fails at a later ramp step: half the time at 0.75)
    full = Ring([replace(m, weight=1.0) if m.id == new.name else m for m in v0.members])
    at_full = {k for k, m in zip(fresh, full.owners([placement_hash(c.namespace, k)
                                                     for k in fresh]))
               if m.address == new.address}
    assert 0 < len(mine) and set(mine) < at_full, (len(mine), len(at_full), weight)
    with Client([new.address], token=TOKEN, timeout_ms=5000) as direct:
        assert direct.get_batch(mine) == [value_for(k, SIZE) for k in mine]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("on_join", ["false", "true"])
def test_join_ramps_the_newcomer_and_every_acked_key_stays_readable(make_cluster, on_join):
    cl = start_cluster(make_cluster, 3, "32MiB", slab="1MiB", join_ramp_s=RAMP_S,
                       master_extra=["--join-timeout-s", "120"],
                       extra=["--handoff-on-join", on_join])
    keys = [f"ramp-{i}".encode() for i in range(N)]
    with Client(masters=cl.master_addresses, token=TOKEN, timeout_ms=5000) as c:
        put_all(c, keys, SIZE)
        load = OracleLoad(c, keys, SIZE, write=True).start()
        name = cl.servers[0].name.rsplit("-", 1)[0] + "-new"
        watch = JoinWatch(cl, name)
        try:
            t0 = time.monotonic()
            new = add_server(cl, name)
            wait_for(lambda: new.name in {m.id for m in c.view.members}, 10)
            _writes_reach_the_joining_newcomer(c, new)
            wait_for(lambda: watch.state() == "up", 90)
            took = time.monotonic() - t0
        finally:
            seen = watch.stop()
            load.stop()
        joining = [r for s, r in seen if s == "joining"]
        assert joining[0] == 0.25 and joining == sorted(joining), seen
        assert {0.25, 0.5, 0.75} <= set(joining), seen
        assert seen[-1] == ("up", 1.0) and took >= RAMP_S - 1.0, (seen, took)
        assert {m.id: m.weight for m in c.view.members}[new.name] == 1.0
        assert load.wrong == [] and load.reads > 500
        assert load.misses == 0, f"{load.misses} of {load.reads} reads missed"
        assert len(load.written) > 100
        got = read_back(c, keys + load.written, SIZE)
        assert got.wrong == [] and got.missing == [], (len(got.missing), got.missing[:3])
        if on_join == "true":  # the slice was handed off: the newcomer holds its keys
            moved = [k for k, a in zip(keys, c.owners(keys)) if a == new.address]
            with Client([new.address], token=TOKEN, timeout_ms=5000) as direct:
                assert direct.get_batch(moved) == [value_for(k, SIZE) for k in moved]


@pytest.mark.timeout(180)
def test_join_stays_joining_while_a_holder_has_objects_left(make_cluster):
    timeout_s = 10.0
    # a handoff cap of 1 KB/s: the old owners' first batch waits about a minute
    cl = start_cluster(make_cluster, 3, "32MiB", slab="1MiB", join_ramp_s=2.0,
                       master_extra=["--join-timeout-s", str(timeout_s)],
                       extra=["--handoff-on-join", "true", "--migrate-mbps", "0.001"])
    keys = [f"held-{i}".encode() for i in range(400)]
    with Client(masters=cl.master_addresses, token=TOKEN, timeout_ms=5000) as c:
        put_all(c, keys, SIZE)
        name = cl.servers[0].name.rsplit("-", 1)[0] + "-new"
        watch = JoinWatch(cl, name)
        try:
            t0 = time.monotonic()
            add_server(cl, name)
            wait_for(lambda: watch.seen and watch.seen[-1] == ("joining", 1.0), 30)
            full = time.monotonic()
            time.sleep(2.5)  # ramp full, passes not finished: still joining
            assert watch.state() == "joining", watch.seen
            rows = masters(cl).status()["members"]
            left = {m["id"]: (m.get("stats") or {}).get("handoff_objects_left", 0)
                    for m in rows if m["id"] != name}
            assert sum(left.values()) > 0, left
            # every acknowledged key still reads, from its previous owner
            got = read_back(c, keys, SIZE)
            assert got.wrong == [] and got.missing == []
            wait_for(lambda: watch.state() == "up", timeout_s + 20)
            took = time.monotonic() - t0
        finally:
            watch.stop()
        assert took >= timeout_s - 1.0 and time.monotonic() - full > 2.0, took
