"""Operator CLI (gcache status / admin), master auth, and NOT_OWNER re-routing by epoch."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from gcache.discovery import MasterClient, MasterError
from gcache.sdk import Client, Status
from gcache.testing.cluster import Cluster
from gcache.view import View
from gcache.testing.waiting import wait_for as _wait_for

pytestmark = [pytest.mark.integration]

GCACHE = [sys.executable, "-m", "gcache.cli"]


def wait_for(pred, timeout: float):
    return _wait_for(pred, timeout, retry_on=(Exception,))


@pytest.fixture
def tcluster(tmp_path):
    cl = Cluster(2, "32MiB", slab="1MiB", masters=3, token="tok", log_dir=str(tmp_path))
    cl.start()
    mc = MasterClient(cl.master_addresses, "tok")
    wait_for(lambda: sum(m["state"] == "up" for m in mc.view()["members"]) == 2, 20)
    yield cl
    cl.close()


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*GCACHE, *args], capture_output=True, text=True, timeout=60)


def test_status_json_and_table(tcluster):
    masters = ",".join(tcluster.master_addresses)
    r = run_cli("status", "--masters", masters, "--token", "tok", "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["leader"] in tcluster.master_addresses and doc["epoch"] >= 2
    assert {m["id"] for m in doc["members"]} == {s.name for s in tcluster.servers}
    wait_for(lambda: all(m["stats"] for m in MasterClient(tcluster.master_addresses, "tok")
                         .status()["members"]), 5)
    doc = MasterClient(tcluster.master_addresses, "tok").status()
    assert all(m["stats"]["nixl"] == 0 and m["stats"]["shm_leases"] == 0
               for m in doc["members"])  # fast-path state rides the heartbeats
    r = run_cli("status", "--masters", masters, "--token", "tok")
    assert r.returncode == 0 and "epoch" in r.stdout and tcluster.servers[0].name in r.stdout
    r = run_cli("status", "--masters", masters, "--token", "tok", "-o", "wide")
    assert r.returncode == 0 and tcluster.servers[0].name in r.stdout
    assert "nixl" in r.stdout and "leases" in r.stdout


def test_admin_drain_add_remove(tcluster):
    masters = ",".join(tcluster.master_addresses)
    mc = MasterClient(tcluster.master_addresses, "tok")
    name = tcluster.servers[0].name
    r = run_cli("admin", "drain", name, "--masters", masters, "--token", "tok")
    assert r.returncode == 0 and "draining" in r.stdout
    with Client(masters=tcluster.master_addresses, token="tok") as c:
        wait_for(lambda: [m.id for m in c.view.members] == [tcluster.servers[1].name], 5)
    r = run_cli("admin", "add", name, "--masters", masters, "--token", "tok")
    assert r.returncode == 0 and "up" in r.stdout
    r = run_cli("admin", "remove", "no-such-server", "--masters", masters, "--token", "tok")
    assert r.returncode != 0 and "no member" in r.stderr
    r = run_cli("admin", "remove", name, "--masters", masters, "--token", "tok")
    assert r.returncode == 0
    # a running server that was removed registers again on its next heartbeat
    wait_for(lambda: any(m["id"] == name and m["state"] == "up"
                         for m in mc.view()["members"]), 5)


def test_master_api_requires_the_token(tcluster):
    with pytest.raises(MasterError) as e:
        MasterClient(tcluster.master_addresses, "wrong").view()
    assert e.value.code == 401
    r = run_cli("status", "--masters", ",".join(tcluster.master_addresses))
    assert r.returncode != 0 and "token" in r.stderr


def test_stale_view_gets_not_owner_then_refreshes_and_retries(tcluster):
    mc = MasterClient(tcluster.master_addresses, "tok")
    a, b = tcluster.servers
    with Client(masters=tcluster.master_addresses, token="tok", timeout_ms=2000) as c:
        current = c.view
        # a must route by the current view too, or it rightly takes the stale client's
        # puts as its own (a server defers to a client whose view is as new as its own);
        # its handoff pass for a view ends after it adopted that view
        wait_for(lambda: c.stats()[a.address]["handoff_epoch"] >= current.epoch, 10)
        # keys the current view places on b
        keys = [f"k{i}".encode() for i in range(200)]
        on_b = [k for k, o in zip(keys, c.owners(keys)) if o == b.address][:20]
        assert on_b
        # pretend this client missed an epoch: an older view that routes everything to a
        stale = View(current.epoch - 1, tuple(m for m in current.members if m.id == a.name))
        c._router.install(stale)
        assert set(c.owners(on_b)) == {a.address}
        st = c.put_batch(on_b, [b"v"] * len(on_b))
        assert st == [Status.OK] * len(on_b)  # a answered NOT_OWNER, the SDK re-routed to b
        assert c.view.epoch == current.epoch  # and it refreshed its view
        stats = c.stats()
        assert stats[a.address]["objects"] == 0 and stats[b.address]["objects"] == len(on_b)
        assert c.get_batch(on_b) == [b"v"] * len(on_b)
    assert mc.view()["epoch"] == current.epoch
