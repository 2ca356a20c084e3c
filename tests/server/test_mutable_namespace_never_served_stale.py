"""The freshness rule with real processes (masters and servers): a server never serves a
``mutable`` namespace's value older than one acknowledged elsewhere while it was away or
while the key's range had another owner; ``content`` namespaces keep everything.

* kill -9 a server, write new values of its mutable keys while it is DOWN (they land on
  other owners), restart it under its name: its mutable keys are never read back at
  their old value (the new one, or a miss), its content keys are still hits;
* a restart with no membership change in between keeps the mutable keys;
* a range that moves away and back (a 4th server joins, then is removed) loses the
  mutable objects its owner held from before, and only those;
* a handoff read (``"ho": 1``) of a mutable namespace is a MISS at a non-owner.
"""

from __future__ import annotations

import os
import time

import pytest

from gcache.hashing import placement_hash
from gcache.protocol import Limits, Op
from gcache.sdk import Client, Status
from gcache.sdk.transports.base import GetItem, Work
from gcache.sdk.transports.tcp import TcpTransport
from gcache.testing.cluster import ServerProc
from gcache.testing.oracle import value_for
from gcache.testing.waiting import wait_for
from handoffops import TOKEN, add_server, masters, up_members

pytestmark = [pytest.mark.integration, pytest.mark.faults]

MUT, CONTENT = b"mut", b"kv"
SIZE = 2000


def v1(k: bytes) -> bytes:
    return value_for(k, SIZE)


def v2(k: bytes) -> bytes:
    return value_for(b"v2-" + k, SIZE)


def _cluster(make_cluster, n: int, heartbeat_timeout_ms: int = 1500, extra=()):
    cl = make_cluster(n, "32MiB", masters=3, token=TOKEN, heartbeat_timeout_ms=heartbeat_timeout_ms,
                      server_extra=["--mutable-namespaces", "mut,other-*", *extra])
    wait_for(lambda: len(up_members(cl)) == n, 30, retry_on=(Exception,))
    return cl


def _client(cl, ns: bytes) -> Client:
    return Client(masters=cl.master_addresses, token=TOKEN, namespace=ns, timeout_ms=5000)


def _epoch_file(s: ServerProc) -> int:
    try:
        with open(os.path.join(s.shm_dir, f"gcache-{s.name}.epoch")) as fh:
            return int(fh.read())
    except (OSError, ValueError):
        return -1


def _settled(cl, servers: list[ServerProc], clients: list[Client], after: int = -1) -> int:
    """Wait until every server in ``servers`` persisted (so adopted) the masters' current
    epoch, newer than ``after`` (a master may lag behind a change just made), and every
    client routes by it; that epoch."""
    def check():
        e = masters(cl).view()["epoch"]
        if e > after and all(_epoch_file(s) == e for s in servers) and all(c.view.epoch == e
                                                                for c in clients):
            return e
        return None
    return wait_for(check, 30, retry_on=(Exception,))


def _stat(c: Client, s: ServerProc, name: str) -> int:
    return int(c.stats()[s.address].get(name, 0))


def _keys_on(c: Client, s: ServerProc, prefix: str, n: int) -> list[bytes]:
    keys = [f"{prefix}{i}".encode() for i in range(40 * n)]
    return [k for k, o in zip(keys, c.owners(keys)) if o == s.address][:n]


@pytest.mark.timeout(240)
def test_restart_after_a_change_never_serves_old_mutable_values_keeps_content(make_cluster):
    cl = _cluster(make_cluster, 3)
    a = cl.servers[0]
    with _client(cl, MUT) as mut, _client(cl, CONTENT) as kv:
        _settled(cl, cl.servers, [mut, kv])
        mkeys, ckeys = _keys_on(mut, a, "m", 30), _keys_on(kv, a, "c", 30)
        assert len(mkeys) == len(ckeys) == 30
        assert mut.put_batch(mkeys, [v1(k) for k in mkeys]) == [Status.OK] * 30
        assert kv.put_batch(ckeys, [v1(k) for k in ckeys]) == [Status.OK] * 30

        a.kill9()
        wait_for(lambda: a.name not in up_members(cl), 30, retry_on=(Exception,))
        wait_for(lambda: a.address not in mut.owners(mkeys), 10)
        # while a is away, its mutable keys get new values elsewhere
        assert mut.put_batch(mkeys, [v2(k) for k in mkeys]) == [Status.OK] * 30

        down = masters(cl).view()["epoch"]
        a.start(60)
        wait_for(lambda: a.name in up_members(cl), 30, retry_on=(Exception,))
        _settled(cl, cl.servers, [mut, kv], down)
        assert mut.owners(mkeys) == [a.address] * 30
        assert _stat(mut, a, "stale_dropped") >= 30

        got = mut.get_batch(mkeys)
        stale = [k for k, v in zip(mkeys, got) if v == v1(k)]
        assert stale == []
        assert all(v is None or v == v2(k) for k, v in zip(mkeys, got))
        # the content namespace restarted warm: every key a hit at a
        wait_for(lambda: kv.get_batch(ckeys) == [v1(k) for k in ckeys], 15)


@pytest.mark.timeout(240)
def test_restart_without_a_change_keeps_mutable_values(make_cluster):
    # a long heartbeat timeout: the restart is over before the masters would mark a down
    cl = _cluster(make_cluster, 3, heartbeat_timeout_ms=30000)
    a = cl.servers[0]
    with _client(cl, MUT) as mut:
        e = _settled(cl, cl.servers, [mut])
        mkeys = _keys_on(mut, a, "m", 30)
        assert mut.put_batch(mkeys, [v1(k) for k in mkeys]) == [Status.OK] * 30
        a.kill9()
        a.start(60)
        # one change only: a's own registration (a new incarnation)
        assert _settled(cl, cl.servers, [mut], e) == e + 1
        assert mut.owners(mkeys) == [a.address] * 30
        # (the client skips a for a probe interval after the failures the kill caused)
        wait_for(lambda: mut.get_batch(mkeys) == [v1(k) for k in mkeys], 15)
        assert _stat(mut, a, "stale_dropped") == 0


@pytest.mark.timeout(300)
def test_range_that_moved_away_and_back_drops_only_its_mutable_objects(make_cluster):
    # join handoff off: the old owners keep their v1 copies while the newcomer owns the
    # range (with it on they hand them over and delete them), the case the rule is for
    cl = _cluster(make_cluster, 3, extra=["--handoff-on-join", "false"])
    olds = list(cl.servers)
    with _client(cl, MUT) as mut, _client(cl, b"other-x") as other, \
            _client(cl, CONTENT) as kv:
        clients = [mut, other, kv]
        _settled(cl, olds, clients)
        mkeys = [f"r{i}".encode() for i in range(600)]
        assert mut.put_batch(mkeys, [v1(k) for k in mkeys]) == [Status.OK] * len(mkeys)
        okeys = mkeys[:200]  # a second mutable namespace (matched by its glob)
        assert other.put_batch(okeys, [v1(k) for k in okeys]) == [Status.OK] * len(okeys)
        assert kv.put_batch(mkeys, [v1(k) for k in mkeys]) == [Status.OK] * len(mkeys)
        before = dict(zip(mkeys, mut.owners(mkeys)))

        e = _settled(cl, olds, clients)
        d = add_server(cl, cl.servers[0].name + "-d")
        wait_for(lambda: d.name in up_members(cl), 30, retry_on=(Exception,))
        e = _settled(cl, olds + [d], clients, e)
        moved = [k for k, o in zip(mkeys, mut.owners(mkeys)) if o == d.address]
        # (the namespace is part of the placement: each namespace moves its own keys)
        moved_other = [k for k, o in zip(okeys, other.owners(okeys)) if o == d.address]
        stayed = [k for k in mkeys if k not in set(moved)]
        assert 30 < len(moved) < 400
        # while d owns them, they get new values there
        assert mut.put_batch(moved, [v2(k) for k in moved]) == [Status.OK] * len(moved)

        d.terminate()
        masters(cl).admin("remove", d.name)
        _settled(cl, olds, clients, e)
        assert mut.owners(mkeys) == [before[k] for k in mkeys]  # the ranges came back
        dropped = sum(_stat(mut, s, "stale_dropped") for s in olds)
        assert dropped == len(moved) + len(moved_other)

        got = mut.get_batch(moved)
        assert [k for k, v in zip(moved, got) if v == v1(k)] == []  # never the old value
        assert mut.get_batch(stayed) == [v1(k) for k in stayed]  # the rest kept
        assert other.get_batch(moved_other) == [None] * len(moved_other)
        assert other.get_batch(okeys) == [None if k in set(moved_other) else v1(k)
                                          for k in okeys]
        assert kv.get_batch(mkeys) == [v1(k) for k in mkeys]  # content: all kept


@pytest.mark.timeout(180)
def test_handoff_read_of_a_mutable_namespace_is_a_miss_at_a_non_owner(make_cluster):
    # a 1 KB/s handoff cap: the drained server keeps what it holds for the test's length
    cl = _cluster(make_cluster, 2, extra=["--migrate-mbps", "0.001"])
    a, b = cl.servers
    with _client(cl, MUT) as mut, _client(cl, CONTENT) as kv:
        _settled(cl, cl.servers, [mut, kv])
        keys = {MUT: _keys_on(mut, b, "h", 10), CONTENT: _keys_on(kv, b, "h", 10)}
        assert mut.put_batch(keys[MUT], [v1(k) for k in keys[MUT]]) == [Status.OK] * 10
        assert kv.put_batch(keys[CONTENT], [v1(k) for k in keys[CONTENT]]) == [Status.OK] * 10
        masters(cl).admin("drain", b.name)
        wait_for(lambda: [m.id for m in mut.view.members] == [a.name], 10)
        epoch = mut.view.epoch
    t = TcpTransport(b.address, TOKEN, Limits(), 2.0)
    try:
        def get(ns: bytes, ep: int, **flags) -> list[Status]:
            gets = [GetItem(k, 0, 1 << 20, 0, None, i) for i, k in enumerate(keys[ns])]
            extra = {"ep": ep, "ph": [placement_hash(ns, k) for k in keys[ns]], **flags}
            return [r.status for r in t.execute(Work(Op.GET, ns, gets, time.monotonic() + 5,
                                                     None, extra))]
        # b adopted the drain once a client of the epoch before it gets NOT_OWNER
        wait_for(lambda: get(CONTENT, epoch - 1) == [Status.NOT_OWNER] * 10, 10)
        # a handoff read: content is served, the mutable namespace is not
        assert get(CONTENT, epoch, ho=1) == [Status.OK] * 10
        assert get(MUT, epoch, ho=1) == [Status.MISS] * 10
        assert get(MUT, epoch - 1, ho=1) == [Status.MISS] * 10
    finally:
        t.close()
