"""A NOT_OWNER reply re-routes on the client's one re-route thread, and a hung master
cannot hold the op past its deadline.

Real processes: two servers and three masters. The client is made to route by a
stale view (an older epoch that sends every key to server A), so A answers the keys
it does not own NOT_OWNER, and the client must refresh its view from the masters
before re-sending. With every master SIGSTOPped the refresh cannot finish: each op
must still end by its deadline (TIMEOUT), and many NOT_OWNER replies at once must not
start a thread each (the client used to start one per reply, each blocked on the
masters until its op's deadline). Once the masters run again, the same re-route
lands every key on its owner.
"""

from __future__ import annotations

import threading
import time

import pytest

from gcache.discovery import MasterClient
from gcache.sdk import Client, Status
from gcache.testing.waiting import wait_for
from gcache.view import View

pytestmark = [pytest.mark.integration, pytest.mark.faults]

TIMEOUT_MS = 1500
SLACK_S = 0.5  # scheduling noise on a loaded 2-core machine
CALLS = 24  # separate ops, so as many NOT_OWNER replies arrive together


@pytest.fixture
def mcluster(make_cluster):
    cl = make_cluster(2, "32MiB", slab="1MiB", masters=3, token="tok")
    mc = MasterClient(cl.master_addresses, "tok")
    wait_for(lambda: sum(m["state"] == "up" for m in mc.view()["members"]) == 2, 30)
    return cl


def _stale_client(cl) -> tuple[Client, list[bytes], View]:
    a, b = cl.servers
    c = Client(masters=cl.master_addresses, token="tok", timeout_ms=TIMEOUT_MS)
    wait_for(lambda: len(c.view.members) == 2, 10)
    current = c.view
    # A must know the current view too, or it takes B's keys from the stale client
    # (its handoff's finished pass at that epoch says it adopted it; a loaded CI run
    # once found A still at the older epoch)
    wait_for(lambda: c.stats()[a.address].get("handoff_epoch", -1) >= current.epoch, 15)
    keys = [f"k{i}".encode() for i in range(400)]
    on_b = [k for k, o in zip(keys, c.owners(keys)) if o == b.address][:CALLS]
    assert len(on_b) == CALLS
    # pretend this client missed an epoch: an older view that routes everything to A
    c._router.install(View(current.epoch - 1, tuple(m for m in current.members
                                                    if m.id == a.name)))
    assert set(c.owners(on_b)) == {a.address}
    return c, on_b, current


@pytest.mark.timeout(120)
def test_hung_masters_cost_a_not_owner_reroute_its_deadline_and_no_threads(mcluster):
    c, on_b, _ = _stale_client(mcluster)
    try:
        for m in mcluster.masters:
            m.pause()
        base = threading.active_count()
        t0 = time.monotonic()
        futs = [c.put_async(k, b"v") for k in on_b]
        time.sleep(TIMEOUT_MS / 1000 / 2)  # every reply is in, every re-route is held
        during = threading.active_count()
        results = [f.result(TIMEOUT_MS / 1000 + 10) for f in futs]
        took = time.monotonic() - t0
        assert results == [Status.TIMEOUT] * CALLS  # the view could not be refreshed
        assert took < TIMEOUT_MS / 1000 + SLACK_S, f"re-routes took {took:.2f} s"
        assert during - base <= 2, f"{during - base} threads started for {CALLS} replies"
    finally:
        for m in mcluster.masters:
            m.resume()
        c.close()


@pytest.mark.timeout(120)
def test_many_not_owner_replies_reroute_to_the_owner_once_masters_answer(mcluster):
    c, on_b, current = _stale_client(mcluster)
    b = mcluster.servers[1]
    with c:
        futs = [c.put_async(k, b"v%d" % i) for i, k in enumerate(on_b)]
        assert [f.result(10) for f in futs] == [Status.OK] * CALLS
        assert c.view.epoch == current.epoch  # refreshed from the masters
        assert set(c.owners(on_b)) == {b.address}
        assert c.get_batch(on_b) == [b"v%d" % i for i in range(CALLS)]
        stats = c.stats()
        assert stats[b.address]["objects"] == CALLS  # every key landed on its owner


@pytest.mark.timeout(120)
def test_one_key_calls_of_a_stale_client_reroute_to_the_owner(mcluster):
    """A one-key get or exists (no batch: sdk/point.py) answered NOT_OWNER continues as a
    batch: the view is refreshed and the key read at its owner."""
    c, on_b, current = _stale_client(mcluster)
    a = mcluster.servers[0]
    stale = c.view
    with Client(masters=mcluster.master_addresses, token="tok", timeout_ms=5000) as fresh:
        assert fresh.put_batch(on_b[:2], [b"w0", b"w1"]) == [Status.OK] * 2
    with c:
        assert set(c.owners(on_b[:2])) == {a.address}
        assert c.get(on_b[0]) == b"w0"
        assert c.view.epoch == current.epoch  # refreshed from the masters
        c._router.install(stale)
        assert c.owners(on_b[1:2]) == [a.address]
        assert c.exists(on_b[1]) is True
        assert c.view.epoch == current.epoch
