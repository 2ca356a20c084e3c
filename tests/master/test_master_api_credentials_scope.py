"""The master API with --credentials-file, against 3 real masters and a real server.

* A server registers and heartbeats with a ``server = true`` credential
  (``--credential``); clients route with their own data credential.
* A data credential may read the view but gets 403 on /admin, /status, /register
  and /heartbeat, at the leader and at a follower alike (a follower forwards the
  caller's own credential, never one of its own).
* A cluster admin (admin on ``"*"``) may drain; a wrong secret is 401.
* ``POST /self``: a server credential drains or removes only the member it runs as
  (proven by the member's boot id; another boot is 403), and removes it only after
  its drain (409 before).
* SIGHUP on the masters makes a data credential a cluster admin without a restart.
"""

from __future__ import annotations

import os

import pytest

from gcache.discovery import MasterClient, MasterError
from gcache.sdk import Client, Status
from gcache.testing.cluster import Cluster
from gcache.testing.waiting import wait_for as _wait_for

pytestmark = [pytest.mark.integration]

SA, SF, SO = "a" * 24, "f" * 24, "o" * 24


def creds(a_rights: str = '["read", "write"]', a_pattern: str = "team-a/*") -> str:
    return f"""
[[credential]]
id = "team-a"
secret = "{SA}"
grants = [{{ namespaces = "{a_pattern}", rights = {a_rights} }}]

[[credential]]
id = "fleet"
secret = "{SF}"
server = true

[[credential]]
id = "ops"
secret = "{SO}"
grants = [{{ namespaces = "*", rights = ["admin"] }}]
"""


def wait_for(pred, timeout: float):
    return _wait_for(pred, timeout, retry_on=(Exception,))


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for var in list(os.environ):
        if var.startswith("GCACHE_"):
            monkeypatch.delenv(var)


@pytest.fixture
def ccluster(tmp_path):
    path = tmp_path / "credentials.toml"
    path.write_text(creds())
    cl = Cluster(1, "32MiB", slab="1MiB", masters=3, log_dir=str(tmp_path),
                 server_extra=["--credentials-file", str(path), "--credential", f"fleet:{SF}"],
                 master_extra=["--credentials-file", str(path)])
    cl.creds_path = path
    cl.start()
    try:
        for addr in cl.master_addresses:  # every master, followers included, applied it
            ops = MasterClient([addr], f"ops:{SO}")
            wait_for(lambda o=ops: [m["state"] for m in o.view()["members"]] == ["up"], 20)
        yield cl
    finally:
        cl.close()


def leader_and_follower(cl: Cluster) -> tuple[str, str]:
    lead = MasterClient(cl.master_addresses, f"ops:{SO}").view()["leader"]
    return lead, next(a for a in cl.master_addresses if a != lead)


def test_non_admin_credential_gets_403_on_admin_routes(ccluster):
    member = ccluster.servers[0].name
    for addr in leader_and_follower(ccluster):
        a = MasterClient([addr], f"team-a:{SA}")
        assert [m["id"] for m in a.view()["members"]] == [member]
        for fn, args in ((a.admin, ("drain", member)), (a.status, ()),
                         (a.register, ("evil", "127.0.0.1:1", 1 << 30, "boot")),
                         (a.heartbeat, (member, 1, "boot", {}))):
            with pytest.raises(MasterError) as err:
                fn(*args)
            assert err.value.code == 403, (addr, err.value)
        fleet = MasterClient([addr], f"fleet:{SF}")  # a server may not administer either
        with pytest.raises(MasterError) as err:
            fleet.admin("drain", member)
        assert err.value.code == 403
        with pytest.raises(MasterError) as err:
            MasterClient([addr], f"ops:{'x' * 24}").view()
        assert err.value.code == 401
    # still up: nothing above changed the membership
    ops = MasterClient(ccluster.master_addresses, f"ops:{SO}")
    assert [m["state"] for m in ops.view()["members"]] == ["up"]
    # the admin may, through a follower too (forwarded with the admin's own credential)
    _, follower = leader_and_follower(ccluster)
    assert MasterClient([follower], f"ops:{SO}").admin("drain", member)
    wait_for(lambda: [m["state"] for m in ops.view()["members"]] == ["draining"], 10)
    assert MasterClient([follower], f"ops:{SO}").status()["members"][0]["id"] == member


def test_data_credential_routes_by_view_in_its_scope(ccluster):
    masters = ccluster.master_addresses
    with Client(masters=masters, credential=f"team-a:{SA}", namespace="team-a/m",
                timeout_ms=3000, transport="tcp") as c:
        wait_for(lambda: len(c.view.members) == 1, 10)
        assert c.put("k", b"v" * 100) == Status.OK
        assert c.get("k") == b"v" * 100
    with Client(masters=masters, credential=f"team-a:{SA}", namespace="team-b/m",
                timeout_ms=3000, transport="tcp") as c:
        wait_for(lambda: len(c.view.members) == 1, 10)
        assert c.put("k", b"v") == Status.AUTH


def test_sighup_on_masters_grants_admin(ccluster):
    member = ccluster.servers[0].name
    a = MasterClient(ccluster.master_addresses, f"team-a:{SA}")
    with pytest.raises(MasterError):
        a.admin("drain", member)
    ccluster.creds_path.write_text(creds('["admin"]', "*"))
    for m in ccluster.masters:
        m.hup()
    wait_for(lambda: a.admin("drain", member), 10)


def test_server_credential_drains_and_removes_only_its_own_member(ccluster):
    ops = MasterClient(ccluster.master_addresses, f"ops:{SO}")
    (me,) = ops.view()["members"]
    for addr in leader_and_follower(ccluster):
        fleet = MasterClient([addr], f"fleet:{SF}")
        with pytest.raises(MasterError) as err:  # another process's boot: another member
            fleet.self_op("drain", me["id"], "boot-of-another-server")
        assert err.value.code == 403 and "only the member it runs as" in err.value.message
        with pytest.raises(MasterError) as err:
            fleet.self_op("remove", me["id"], me["boot_id"])  # not drained yet
        assert err.value.code == 409 and "only after its drain" in err.value.message
        with pytest.raises(MasterError) as err:
            MasterClient([addr], f"team-a:{SA}").self_op("drain", me["id"], me["boot_id"])
        assert err.value.code == 403
        with pytest.raises(MasterError) as err:
            fleet.self_op("leave", me["id"], me["boot_id"])
        assert err.value.code == 400
    assert [m["state"] for m in ops.view()["members"]] == ["up"]
    # with its own boot id, through a follower too
    _, follower = leader_and_follower(ccluster)
    fleet = MasterClient([follower], f"fleet:{SF}")
    assert fleet.self_op("drain", me["id"], me["boot_id"])["member"]["state"] == "draining"
    wait_for(lambda: [m["state"] for m in ops.view()["members"]] == ["draining"], 10)
    ccluster.servers[0].terminate()  # its heartbeats would register it again after a remove
    assert fleet.self_op("remove", me["id"], me["boot_id"])["member"] is None
    wait_for(lambda: ops.view()["members"] == [], 10)
